//! Chat prompts tokenized segment by segment, with the segments remembered.
//!
//! A HuggingFace tokenizer first splits its input at the added tokens (`<|im_start|>`,
//! `<|eot_id|>`, ...), and only then normalizes and pre-tokenizes each piece between them on its
//! own. So the text between two added tokens tokenizes the same wherever it appears, and a
//! conversation's earlier turns, system prompt or documents need not be tokenized again: each
//! segment's ids come from a bounded cache keyed by a 128-bit hash of its text.
//!
//! The tokenizer matches its added tokens in two rounds: those marked `normalized: false` on the
//! raw text (leftmost, then longest), then those marked `normalized: true` on the normalized text
//! of each piece between (DeepSeek's `<｜User｜>` and `<think>` are of the second kind). With no
//! normalizer, or one that does nothing (an empty `Sequence`, as DeepSeek's tokenizer.json has),
//! the normalized text is the raw text, so the same two rounds over the raw text find the same
//! tokens; that is what [`SegmentTokenizer::encode`] does.
//!
//! Invariants: the ids equal a whole-prompt `encode(text, false)`; that holds only for tokenizers
//! whose added tokens match text exactly (no `lstrip`/`rstrip`/`single_word`), with no normalizer
//! or one that changes nothing, and a byte-level pre-tokenizer that adds no prefix space (GPT-2,
//! Llama 3, Qwen, DeepSeek style); [`SegmentTokenizer::new`] returns None for any other, and the
//! caller tokenizes whole. The cache holds about `capacity` token ids at most
//! ([`super::generations`]: recently used segments survive).

use std::sync::Arc;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};

/// What an entry weighs beyond its ids (its key, table slot and allocation: ~64 bytes), so many
/// short segments cannot hold more memory than the capacity says.
const ENTRY_OVERHEAD_IDS: usize = 16;

pub use super::generations::CacheStats as SegmentStats;
use super::generations::ContentCache;

pub struct SegmentTokenizer {
    /// The added tokens matched on the raw text (`normalized: false`); None when it has none.
    raw: Option<Matcher>,
    /// The added tokens matched in what lies between those (`normalized: true`); None when the
    /// tokenizer has none.
    normalized: Option<Matcher>,
    /// Segment text hash → its ids, weighed in ids.
    cache: ContentCache<Arc<[u32]>>,
    capacity: usize,
}

impl std::fmt::Debug for SegmentTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentTokenizer")
            .field(
                "added_tokens",
                &[&self.raw, &self.normalized]
                    .iter()
                    .map(|m| m.as_ref().map_or(0, |m| m.pieces.len()))
                    .sum::<usize>(),
            )
            .field("capacity", &self.capacity)
            .finish()
    }
}

/// Added tokens found as the tokenizer finds them: leftmost, then longest.
struct Matcher {
    ac: AhoCorasick,
    /// Each pattern's token id as a one-id piece (shared by every prompt).
    pieces: Vec<Arc<[u32]>>,
}

impl Matcher {
    /// `Some(None)` when there are no tokens; None when the automaton cannot be built (then
    /// segments are off).
    fn new(mut added: Vec<(u32, String)>) -> Option<Option<Self>> {
        if added.is_empty() {
            return Some(None);
        }
        added.sort();
        let ac = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(added.iter().map(|(_, c)| c.as_str()))
            .ok()?;
        let pieces = added.into_iter().map(|(id, _)| Arc::from([id])).collect();
        Some(Some(Matcher { ac, pieces }))
    }
}

/// `text` cut at `m`'s tokens: their one-id pieces into `out`, what lies between them (empty
/// pieces too) to `rest`, in order; all of `text` to `rest` without a matcher.
fn split<E>(
    m: Option<&Matcher>,
    text: &str,
    out: &mut Vec<Arc<[u32]>>,
    mut rest: impl FnMut(&str, &mut Vec<Arc<[u32]>>) -> Result<(), E>,
) -> Result<(), E> {
    let Some(m) = m else {
        return rest(text, out);
    };
    let mut at = 0;
    for hit in m.ac.find_iter(text) {
        rest(&text[at..hit.start()], out)?;
        out.push(m.pieces[hit.pattern().as_usize()].clone());
        at = hit.end();
    }
    rest(&text[at..], out)
}

/// Whether `v` (a serialized normalizer) changes nothing: an empty `Sequence`, or one of such.
fn normalizes_nothing(v: &serde_json::Value) -> bool {
    v["type"].as_str() == Some("Sequence")
        && v["normalizers"]
            .as_array()
            .is_some_and(|ns| ns.iter().all(normalizes_nothing))
}

/// Whether `v` (a serialized pre-tokenizer) is byte-level without a prefix space, possibly
/// behind splits.
fn byte_level_without_prefix(v: &serde_json::Value) -> bool {
    match v["type"].as_str() {
        Some("ByteLevel") => v["add_prefix_space"] == false,
        Some("Sequence") => v["pretokenizers"].as_array().is_some_and(|ps| {
            ps.iter().all(|p| {
                matches!(p["type"].as_str(), Some("Split" | "Digits" | "Punctuation"))
                    || byte_level_without_prefix(p)
            }) && ps.iter().any(byte_level_without_prefix)
        }),
        _ => false,
    }
}

impl SegmentTokenizer {
    /// Segment tokenization for `tok` with room for about `capacity` cached token ids, when it is
    /// exact for that tokenizer (see the module doc); None otherwise.
    pub fn new(tok: &tokenizers::Tokenizer, capacity: usize) -> Option<Self> {
        if let Some(n) = tok.get_normalizer() {
            if !normalizes_nothing(&serde_json::to_value(n).ok()?) {
                return None;
            }
        }
        let pre = serde_json::to_value(tok.get_pre_tokenizer()?).ok()?;
        if !byte_level_without_prefix(&pre) {
            return None;
        }
        let (mut raw, mut normalized) = (Vec::new(), Vec::new());
        for (id, t) in tok.get_added_tokens_decoder() {
            if t.lstrip || t.rstrip || t.single_word || t.content.is_empty() {
                return None;
            }
            let round = if t.normalized {
                &mut normalized
            } else {
                &mut raw
            };
            round.push((id, t.content.clone()));
        }
        Some(SegmentTokenizer {
            raw: Matcher::new(raw)?,
            normalized: Matcher::new(normalized)?,
            cache: ContentCache::new(capacity, ENTRY_OVERHEAD_IDS),
            capacity,
        })
    }

    pub fn stats(&self) -> SegmentStats {
        self.cache.stats()
    }

    /// The ids of `text` (no special tokens added), a segment at a time, as the pieces they
    /// come in: each segment's ids as the cache holds them and each added token's one-id piece,
    /// shared, never copied into one array; `encode` tokenizes one segment (the tokenizer,
    /// without special tokens).
    pub fn encode_pieces<E>(
        &self,
        text: &str,
        mut encode: impl FnMut(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Vec<Arc<[u32]>>, E> {
        let mut out: Vec<Arc<[u32]>> = Vec::new();
        let mut piece = |seg: &str, out: &mut Vec<Arc<[u32]>>| -> Result<(), E> {
            if seg.is_empty() {
                return Ok(());
            }
            // Short segments too: the fixture tokenizer takes 2.7 µs for one letter and 27 µs for a
            // 49-byte question, a lookup tens of nanoseconds.
            let ids = self.cache.get_or_make(seg.as_bytes(), || {
                let ids: Arc<[u32]> = encode(seg)?.into();
                let n = ids.len();
                Ok((ids, n))
            })?;
            if !ids.is_empty() {
                out.push(ids);
            }
            Ok(())
        };
        // Between the raw round's tokens, the normalized round's; between those, segments.
        let normalized = self.normalized.as_ref();
        split(self.raw.as_ref(), text, &mut out, |between, out| {
            split(normalized, between, out, &mut piece)
        })?;
        Ok(out)
    }

    /// [`Self::encode_pieces`] as one array.
    pub fn encode<E>(
        &self,
        text: &str,
        encode: impl FnMut(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Vec<u32>, E> {
        let pieces = self.encode_pieces(text, encode)?;
        let mut out = Vec::with_capacity(pieces.iter().map(|p| p.len()).sum());
        for p in &pieces {
            out.extend_from_slice(p);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use crate::request::tokenize::ModelTokenizer;
    use serde_json::value::RawValue;

    fn fixture() -> ModelTokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
        ModelTokenizer::load(&dir).expect("fixture tokenizer")
    }

    /// Random message text: words, whitespace runs, punctuation, digits, non-ASCII, and now and
    /// then an added token's text inside the content.
    fn text(rng: &mut fastrand::Rng, words: usize) -> String {
        const PIECES: &[&str] = &[
            "the",
            " model",
            "  ",
            "\n",
            "\n\n",
            "tokens",
            "é",
            "中文",
            "🙂",
            "123",
            "4567",
            ",",
            ".",
            "?!",
            "\t",
            "cache",
            " KV",
            "<|im_end|>",
            "<s>",
            "don't",
            "'s",
            "  x",
            "",
        ];
        (0..words)
            .map(|_| PIECES[rng.usize(..PIECES.len())])
            .collect::<Vec<_>>()
            .join(if rng.bool() { " " } else { "" })
    }

    #[test]
    fn segment_ids_equal_whole_prompt_ids_on_fixtures_and_generated_conversations() {
        let t = fixture();
        assert!(
            t.segment_stats().is_some(),
            "the byte-level fixture tokenizes by segment"
        );
        let fixtures: serde_json::Value = serde_json::from_slice(
            &std::fs::read(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/fixtures/tokenizer/expected.json"),
            )
            .expect("expected.json"),
        )
        .expect("json");
        for case in fixtures["chats"].as_array().expect("chats") {
            let raw = RawValue::from_string(case["messages"].to_string()).expect("raw");
            let text = t.render_chat(&raw).expect("render");
            assert_eq!(t.text_ids(&text).unwrap(), t.text_ids_whole(&text).unwrap());
            let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).expect("ids");
            assert_eq!(
                t.chat_ids(&raw).unwrap(),
                want,
                "the Python tokenizer's ids"
            );
        }
        let mut rng = fastrand::Rng::with_seed(7);
        for conversation in 0..20 {
            let mut messages =
                vec![serde_json::json!({"role": "system", "content": text(&mut rng, 40)})];
            for turn in 0..6 {
                let role = if turn % 2 == 0 { "user" } else { "assistant" };
                let words = 10 + rng.usize(..60);
                messages.push(serde_json::json!({"role": role, "content": text(&mut rng, words)}));
                let raw =
                    RawValue::from_string(serde_json::Value::from(messages.clone()).to_string())
                        .expect("raw");
                let rendered = t.render_chat(&raw).expect("render");
                assert_eq!(
                    t.text_ids(&rendered).unwrap(),
                    t.text_ids_whole(&rendered).unwrap(),
                    "conversation {conversation}, turn {turn}:\n{rendered:?}"
                );
            }
        }
        let s = t.segment_stats().expect("stats");
        assert!(
            s.hits > s.misses,
            "later turns reuse earlier segments: {s:?}"
        );
    }

    #[test]
    fn the_cache_stays_bounded_and_keeps_recent_segments() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
        let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).expect("tokenizer");
        let seg = super::SegmentTokenizer::new(&tok, 2_000).expect("exact for the fixture");
        let enc = |s: &str| -> Result<Vec<u32>, String> {
            tok.encode_fast(s, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| e.to_string())
        };
        let doc = |i: usize| format!("document {i}: {}", "some words of text ".repeat(8));
        for i in 0..200 {
            seg.encode(&doc(i), enc).unwrap();
        }
        let held = seg.cache.weight();
        assert!(held <= 2_000, "{held} ids held");
        let before = seg.stats();
        seg.encode(&doc(199), enc).unwrap();
        assert_eq!(
            seg.stats().hits,
            before.hits + 1,
            "the latest segment is still cached"
        );
        seg.encode(&doc(0), enc).unwrap();
        assert_eq!(
            seg.stats().misses,
            before.misses + 1,
            "the oldest was dropped"
        );
    }

    #[test]
    fn tokenizers_where_segments_are_not_exact_tokenize_whole() {
        // A normalizer (or a prefix space) changes how a piece tokenizes at its start.
        let mut json = fixture_json();
        json["pre_tokenizer"]["add_prefix_space"] = true.into();
        let tok = tokenizers::Tokenizer::from_bytes(json.to_string()).unwrap();
        assert!(super::SegmentTokenizer::new(&tok, 1000).is_none());
        json["pre_tokenizer"]["add_prefix_space"] = false.into();
        json["added_tokens"][2]["lstrip"] = true.into();
        let tok = tokenizers::Tokenizer::from_bytes(json.to_string()).unwrap();
        assert!(super::SegmentTokenizer::new(&tok, 1000).is_none());
    }

    /// The fixture's tokenizer.json, to vary.
    fn fixture_json() -> serde_json::Value {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap()
    }

    /// A tokenizer of both rounds (see the module doc): the fixture with added tokens marked
    /// `normalized` that overlap the raw ones every way (inside, before, after), behind a
    /// normalizer that does nothing, as DeepSeek's tokenizer.json has.
    fn two_round_tokenizer() -> tokenizers::Tokenizer {
        let mut json = fixture_json();
        json["normalizer"] = serde_json::json!({"type": "Sequence", "normalizers": []});
        let mut tok = tokenizers::Tokenizer::from_bytes(json.to_string()).unwrap();
        let added: Vec<tokenizers::AddedToken> =
            ["x<|im", "end|>x", "im_", " model", "KV c", "e KV"]
                .iter()
                .map(|t| tokenizers::AddedToken::from(*t, false).normalized(true))
                .chain(std::iter::once(tokenizers::AddedToken::from(
                    "cache", false,
                )))
                .collect();
        assert_eq!(tok.add_tokens(&added), added.len());
        tok
    }

    #[test]
    fn normalized_added_tokens_are_matched_after_the_raw_ones_as_the_tokenizer_does() {
        let tok = two_round_tokenizer();
        let seg = super::SegmentTokenizer::new(&tok, 1 << 16).expect("exact: two rounds");
        let enc = |s: &str| -> Result<Vec<u32>, String> {
            tok.encode_fast(s, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| e.to_string())
        };
        // One round over every token would take `x<|im` here; the tokenizer takes `<|im_end|>`.
        let tricky = "ax<|im_end|>x and im_ KV cache";
        assert_eq!(seg.encode(tricky, enc).unwrap(), enc(tricky).unwrap());
        let mut rng = fastrand::Rng::with_seed(11);
        for case in 0..500 {
            let words = 1 + rng.usize(..40);
            // `x` beside `<|im_end|>` makes the overlaps above happen.
            let t = text(&mut rng, words).replace("é", "x");
            assert_eq!(
                seg.encode(&t, enc).unwrap(),
                enc(&t).unwrap(),
                "case {case}: {t:?}"
            );
        }
    }

    #[test]
    fn a_normalizer_that_changes_text_turns_segments_off() {
        let mut json = fixture_json();
        json["normalizer"] =
            serde_json::json!({"type": "Sequence", "normalizers": [{"type": "Lowercase"}]});
        let tok = tokenizers::Tokenizer::from_bytes(json.to_string()).unwrap();
        assert!(super::SegmentTokenizer::new(&tok, 1000).is_none());
        json["normalizer"] = serde_json::json!({"type": "Sequence", "normalizers": [{"type": "Sequence", "normalizers": []}]});
        let tok = tokenizers::Tokenizer::from_bytes(json.to_string()).unwrap();
        assert!(super::SegmentTokenizer::new(&tok, 1000).is_some());
    }
}
