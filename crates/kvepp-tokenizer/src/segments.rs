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
//! A rendered chat prompt ([`SegmentTokenizer::encode_rendered`]) is also compared with the
//! model's last few renders ([`kvepp_request::recent`]): the pieces before the last added token that lies
//! well inside the part they share are taken from that render as they are, and cutting resumes
//! just after that token. Added tokens are found leftmost, then longest, so the tokens found up
//! to a point depend on no byte more than the longest token's length past it; a cut just after a
//! token ending at `e` is taken only when the shared part runs on at least twice that length
//! past `e`, so every token and segment before `e` is what cutting from the start would find.
//! That holds for a token of the second round too: the first-round token that ends the text it
//! was found in either starts at least the longest length past `e` (in both texts: one found
//! earlier in the new text would lie inside the shared part, so the old text has it too) or
//! starts before, and then lies wholly inside the shared part, found in both; either way the
//! second round read the same text up to that length past `e`.
//!
//! Invariants: the ids equal a whole-prompt `encode(text, false)`, resumed or not; that holds
//! only for tokenizers whose added tokens match text exactly (no `lstrip`/`rstrip`/
//! `single_word`), with no normalizer or one that changes nothing, and a byte-level pre-tokenizer
//! that adds no prefix space (GPT-2, Llama 3, Qwen, DeepSeek style); [`SegmentTokenizer::new`]
//! returns None for any other, and the caller tokenizes whole. The cache holds about `capacity`
//! token ids at most ([`kvepp_request::generations`]: recently used segments survive).

use std::sync::Arc;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};

use kvepp_request::recent::{Kept, Recent};

/// A point where cutting may resume: just after an added token ending at byte `end`, with the
/// text's first `pieces` pieces (that token's own included) before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cut {
    end: usize,
    pieces: usize,
}

/// A rendered prompt as it was cut: its pieces, its cuts, and its segments' cache keys with the
/// index of each one's piece, in text order.
#[derive(Debug)]
struct Render {
    text: Vec<u8>,
    pieces: Vec<Arc<[u32]>>,
    cuts: Vec<Cut>,
    keys: Vec<(u128, usize)>,
}

impl Kept for Render {
    fn text(&self) -> &[u8] {
        &self.text
    }
}

/// What an entry weighs beyond its ids (its key, table slot and allocation: ~64 bytes), so many
/// short segments cannot hold more memory than the capacity says.
const ENTRY_OVERHEAD_IDS: usize = 16;

pub use kvepp_request::generations::CacheStats as SegmentStats;
use kvepp_request::generations::ContentCache;

pub struct SegmentTokenizer {
    /// The added tokens matched on the raw text (`normalized: false`); None when it has none.
    raw: Option<Matcher>,
    /// The added tokens matched in what lies between those (`normalized: true`); None when the
    /// tokenizer has none.
    normalized: Option<Matcher>,
    /// Segment text hash → its ids, weighed in ids.
    cache: ContentCache<Arc<[u32]>>,
    capacity: usize,
    /// The longest added token's length in bytes (0: none).
    longest: usize,
    /// The last few rendered prompts as they were cut.
    recent: Recent<Render>,
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
    /// The longest pattern's length in bytes.
    longest: usize,
}

impl Matcher {
    /// `Some(None)` when there are no tokens; None when the automaton cannot be built (then
    /// segments are off).
    fn new(mut added: Vec<(u32, String)>) -> Option<Option<Self>> {
        if added.is_empty() {
            return Some(None);
        }
        added.sort();
        let longest = added.iter().map(|(_, c)| c.len()).max().unwrap_or(0);
        let ac = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(added.iter().map(|(_, c)| c.as_str()))
            .ok()?;
        let pieces = added.into_iter().map(|(id, _)| Arc::from([id])).collect();
        Some(Some(Matcher {
            ac,
            pieces,
            longest,
        }))
    }
}

/// Whether `v` (a serialized normalizer) changes nothing: an empty `Sequence`, or one of such.
pub(super) fn normalizes_nothing(v: &serde_json::Value) -> bool {
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
        let (raw, normalized) = (Matcher::new(raw)?, Matcher::new(normalized)?);
        let longest = [&raw, &normalized]
            .iter()
            .filter_map(|m| m.as_ref().map(|m| m.longest))
            .max()
            .unwrap_or(0);
        Some(SegmentTokenizer {
            raw,
            normalized,
            cache: ContentCache::new(capacity, ENTRY_OVERHEAD_IDS),
            capacity,
            longest,
            recent: Recent::default(),
        })
    }

    /// Whether `text` holds an added token's text (of either round), as the tokenizer would
    /// find it.
    pub fn has_added_token(&self, text: &str) -> bool {
        [&self.raw, &self.normalized]
            .iter()
            .any(|m| m.as_ref().is_some_and(|m| m.ac.is_match(text)))
    }

    pub fn stats(&self) -> SegmentStats {
        self.cache.stats()
    }

    /// Renders that resumed from a recent one (hits) and long ones that could not (misses).
    pub fn render_stats(&self) -> SegmentStats {
        self.recent.stats()
    }

    /// The ids of `text` (no special tokens added), a segment at a time, as the pieces they
    /// come in: each segment's ids as the cache holds them and each added token's one-id piece,
    /// shared, never copied into one array; `encode` tokenizes one segment (the tokenizer,
    /// without special tokens).
    pub fn encode_pieces<E>(
        &self,
        text: &str,
        encode: impl FnMut(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Vec<Arc<[u32]>>, E> {
        let mut c = Cutting::new(self, encode);
        c.text(text, 0)?;
        Ok(c.out)
    }

    /// [`Self::encode_pieces`] of a rendered chat prompt (checked as UTF-8 here; `not_utf8` is
    /// the error when it is not), resumed from the recent render it shares the most with (see
    /// the module doc) and kept for the next one.
    pub fn encode_rendered<E>(
        &self,
        rendered: Vec<u8>,
        not_utf8: impl FnOnce() -> E,
        encode: impl FnMut(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Vec<Arc<[u32]>>, E> {
        let Ok(text) = simdutf8::basic::from_utf8(&rendered) else {
            return Err(not_utf8());
        };
        if self.longest == 0 {
            // No added tokens: one segment, nothing to resume from.
            return self.encode_pieces(text, encode);
        }
        let reach = 2 * self.longest;
        // The last cut the shared part runs on past by `reach` (it ends an added token, so a char
        // boundary of the shared text; checked all the same, so slicing there cannot panic).
        let resume = self.recent.resume(rendered.as_slice(), |r, shared| {
            r.cuts
                .partition_point(|c| c.end + reach <= shared)
                .checked_sub(1)
                .filter(|&i| text.is_char_boundary(r.cuts[i].end))
        });
        let mut c = Cutting::new(self, encode);
        let mut from = 0;
        if let Some(r) = &resume {
            let (kept, cut) = (&r.from, r.from.cuts[r.usable]);
            c.out.extend_from_slice(&kept.pieces[..cut.pieces]);
            c.cuts.extend_from_slice(&kept.cuts[..=r.usable]);
            let keys = &kept.keys[..kept.keys.partition_point(|&(_, i)| i < cut.pieces)];
            c.keys.extend_from_slice(keys);
            // The segments taken stay as recent in the segment cache as if looked up, so a turn
            // that cannot resume later (its render dropped) still finds them there.
            self.cache.keep_all(keys.iter().map(|&(key, i)| {
                let ids = kept.pieces[i].clone();
                let n = ids.len();
                (key, ids, n)
            }));
            from = cut.end;
        }
        c.text(&text[from..], from)?;
        let Cutting {
            out, cuts, keys, ..
        } = c;
        self.recent.remember(
            resume.as_ref(),
            Render {
                text: rendered,
                pieces: out.clone(),
                cuts,
                keys,
            },
        );
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

/// One text being cut into pieces, with the points where a later text that starts alike may
/// resume (see the module doc).
struct Cutting<'s, F> {
    seg: &'s SegmentTokenizer,
    encode: F,
    out: Vec<Arc<[u32]>>,
    cuts: Vec<Cut>,
    /// Each segment piece's cache key and index in `out`.
    keys: Vec<(u128, usize)>,
}

impl<'s, F> Cutting<'s, F> {
    fn new(seg: &'s SegmentTokenizer, encode: F) -> Self {
        Cutting {
            seg,
            encode,
            out: Vec::new(),
            cuts: Vec::new(),
            keys: Vec::new(),
        }
    }

    /// `text` (at byte `start` of the whole): the raw round's tokens, and what lies between them
    /// to [`Self::between`]; a cut after each token.
    fn text<E>(&mut self, text: &str, start: usize) -> Result<(), E>
    where
        F: FnMut(&str) -> Result<Vec<u32>, E>,
    {
        let seg = self.seg;
        self.round(seg.raw.as_ref(), (text, start), Self::between)
    }

    /// Text between the raw round's tokens (at byte `start`): the normalized round's tokens and
    /// the segments between them; a cut after each token (the resume's margin covers where the
    /// text ends: see the module doc).
    fn between<E>(&mut self, text: &str, start: usize) -> Result<(), E>
    where
        F: FnMut(&str) -> Result<Vec<u32>, E>,
    {
        let seg = self.seg;
        self.round(seg.normalized.as_ref(), (text, start), |c, t, _| {
            c.segment(t)
        })
    }

    /// `text` (at byte `start`) cut at `m`'s tokens: their one-id pieces, what lies between them
    /// (empty too) to `inner` with its start, in order; all of it to `inner` without a matcher.
    /// A cut after each token.
    fn round<E>(
        &mut self,
        m: Option<&Matcher>,
        (text, start): (&str, usize),
        inner: fn(&mut Self, &str, usize) -> Result<(), E>,
    ) -> Result<(), E> {
        let Some(m) = m else {
            return inner(self, text, start);
        };
        let mut at = 0;
        for hit in m.ac.find_iter(text) {
            inner(self, &text[at..hit.start()], start + at)?;
            self.out.push(m.pieces[hit.pattern().as_usize()].clone());
            at = hit.end();
            self.cut(start + at);
        }
        inner(self, &text[at..], start + at)
    }

    /// One segment's ids, from the cache or the tokenizer.
    fn segment<E>(&mut self, seg: &str) -> Result<(), E>
    where
        F: FnMut(&str) -> Result<Vec<u32>, E>,
    {
        if seg.is_empty() {
            return Ok(());
        }
        let encode = &mut self.encode;
        // Short segments too: the fixture tokenizer takes 2.7 µs for one letter and 27 µs for a
        // 49-byte question, a lookup tens of nanoseconds.
        let key = ContentCache::<Arc<[u32]>>::key(seg.as_bytes());
        let ids = self.seg.cache.get_or_make_keyed(key, || {
            let ids: Arc<[u32]> = encode(seg)?.into();
            let n = ids.len();
            Ok((ids, n))
        })?;
        if !ids.is_empty() {
            self.keys.push((key, self.out.len()));
            self.out.push(ids);
        }
        Ok(())
    }

    fn cut(&mut self, end: usize) {
        self.cuts.push(Cut {
            end,
            pieces: self.out.len(),
        });
    }
}

#[cfg(test)]
pub(super) mod tests {
    use crate::ModelTokenizer;
    use serde_json::value::RawValue;

    fn fixture() -> ModelTokenizer {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer");
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
                    .join("../../tests/fixtures/tokenizer/expected.json"),
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

    /// `t` cut back to a char boundary at or before `at`.
    fn floor(t: &str, mut at: usize) -> &str {
        at = at.min(t.len());
        while !t.is_char_boundary(at) {
            at -= 1;
        }
        &t[..at]
    }

    /// The tokenizer's own ids of a text, no special tokens added: the reference.
    fn whole(tok: &tokenizers::Tokenizer) -> impl Fn(&str) -> Result<Vec<u32>, String> + Copy + '_ {
        move |s| {
            tok.encode_fast(s, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| e.to_string())
        }
    }

    /// The ids `encode_rendered` gives for `t`, joined.
    fn resumed_ids(
        seg: &super::SegmentTokenizer,
        enc: impl Fn(&str) -> Result<Vec<u32>, String>,
        t: &str,
    ) -> Vec<u32> {
        seg.encode_rendered(t.as_bytes().to_vec(), || "not utf-8".to_string(), enc)
            .unwrap()
            .iter()
            .flat_map(|p| p.iter().copied())
            .collect()
    }

    #[test]
    fn resumed_renders_give_the_whole_prompts_ids() {
        for (name, tok) in [
            (
                "fixture",
                tokenizers::Tokenizer::from_bytes(fixture_json().to_string()).unwrap(),
            ),
            ("two rounds", two_round_tokenizer()),
        ] {
            let seg = super::SegmentTokenizer::new(&tok, 1 << 20).expect("exact");
            let enc = whole(&tok);
            let resumed = |t: &str| resumed_ids(&seg, enc, t);
            let mut rng = fastrand::Rng::with_seed(5);
            // A few conversations that share a start, each going on from a random point of its
            // previous text (inside an added token, just before or after one, anywhere).
            let start = text(&mut rng, 4000).replace("é", "x");
            let mut convs = vec![start.clone(); 3];
            for step in 0..80 {
                let k = rng.usize(..convs.len());
                let prev = &convs[k];
                let at = match prev.rfind("<|im_end|>") {
                    Some(i) if rng.bool() && i > prev.len() / 2 => i + rng.usize(..12),
                    _ => prev.len() - rng.usize(..=prev.len().min(600)),
                };
                let words = 1 + rng.usize(..200);
                let next = format!(
                    "{}{}",
                    floor(prev, at),
                    text(&mut rng, words).replace("é", "x")
                );
                assert_eq!(
                    resumed(&next),
                    enc(&next).unwrap(),
                    "{name}, step {step}: {next:?}"
                );
                convs[k] = next;
            }
            // Added tokens cut short where the shared part ends and completed after it: a
            // token found in the earlier text must not be taken where the later one has a longer
            // or an earlier-starting one (a cut needs the shared part to run on past it).
            let added: Vec<String> = tok
                .get_added_tokens_decoder()
                .into_values()
                .map(|t| t.content)
                .collect();
            let base = text(&mut rng, 1800).replace("é", "x");
            for case in 0..200 {
                let w = format!(
                    "{}{}{}",
                    ["", "x", "a"][rng.usize(..3)],
                    added[rng.usize(..added.len())],
                    added[rng.usize(..added.len())]
                );
                let j = rng.usize(1..w.len());
                let head = format!("{base}{}", floor(&w, j));
                let tail = text(&mut rng, 20);
                let old = format!("{head}Q{tail}");
                let new = format!("{head}{}{tail}", &w[head.len() - base.len()..]);
                for t in [old, new] {
                    assert_eq!(
                        resumed(&t),
                        enc(&t).unwrap(),
                        "{name}, case {case}: {w:?} cut at {j}"
                    );
                }
            }
            let r = seg.render_stats();
            assert!(
                r.hits > 200 && r.misses < 10,
                "{name}: most renders resumed: {r:?}"
            );
            assert_eq!(
                seg.encode_rendered(vec![b'a', 0xff], || "not utf-8".to_string(), enc),
                Err("not utf-8".to_string())
            );
        }
    }

    #[test]
    fn segments_taken_from_a_render_stay_in_the_segment_cache() {
        let tok = tokenizers::Tokenizer::from_bytes(fixture_json().to_string()).unwrap();
        let seg = super::SegmentTokenizer::new(&tok, 30_000).expect("exact");
        let calls = std::cell::Cell::new(0usize);
        let enc = |s: &str| -> Result<Vec<u32>, String> {
            calls.set(calls.get() + 1);
            tok.encode_fast(s, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| e.to_string())
        };
        let mut rng = fastrand::Rng::with_seed(13);
        let mut history = text(&mut rng, 3000);
        seg.encode_rendered(history.clone().into_bytes(), String::new, enc)
            .unwrap();
        for _ in 0..10 {
            // Other traffic turns the segment cache's generations over...
            seg.encode_pieces(&text(&mut rng, 3000), enc).unwrap();
            // ...while the conversation goes on, resumed from its previous render.
            history.push_str("<|im_end|> and on");
            seg.encode_rendered(history.clone().into_bytes(), String::new, enc)
                .unwrap();
        }
        assert!(seg.render_stats().hits >= 10);
        // Its render dropped, the next turn is cut from the start: its earlier segments are
        // still cached.
        seg.recent.clear();
        let before = calls.get();
        history.push_str("<|im_end|> more");
        seg.encode_rendered(history.clone().into_bytes(), String::new, enc)
            .unwrap();
        let new = calls.get() - before;
        assert!(new <= 2, "{new} segments tokenized again");
    }

    #[test]
    fn the_cache_stays_bounded_and_keeps_recent_segments() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer");
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

    /// The fixture's tokenizer.json, to vary (the byte-level BPE's tests vary it too).
    pub(crate) fn fixture_json() -> serde_json::Value {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer");
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

    /// A second-round token just before a first-round one: in a later text that shares the
    /// first-round token only in part, the second round reads on past where the earlier text's
    /// ended (`<a>bcd`, not `<a>`). The cut after `<a>` must not be taken there; the resume's
    /// margin of twice the longest token is what keeps it out (with one longest length this
    /// fails at k = 19).
    #[test]
    fn a_second_round_token_just_before_a_first_round_one_is_not_resumed_past() {
        let mut json = fixture_json();
        json["normalizer"] = serde_json::json!({"type": "Sequence", "normalizers": []});
        let mut tok = tokenizers::Tokenizer::from_bytes(json.to_string()).unwrap();
        let raw = "cdRRRRRRRRRRRRRRRRRR";
        let added = [
            tokenizers::AddedToken::from("<a>", false).normalized(true),
            tokenizers::AddedToken::from("<a>bcd", false).normalized(true),
            tokenizers::AddedToken::from(raw, true).normalized(false),
        ];
        assert_eq!(tok.add_tokens(&added), added.len());
        let seg = super::SegmentTokenizer::new(&tok, 1 << 20).expect("exact: two rounds");
        assert_eq!(
            seg.longest,
            raw.len(),
            "the first-round token is the longest"
        );
        let enc = whole(&tok);
        let resumed = |t: &str| resumed_ids(&seg, enc, t);
        let mut rng = fastrand::Rng::with_seed(9);
        let base = text(&mut rng, 2000).replace("é", "x");
        let before = seg.render_stats();
        for k in 0..raw.len() {
            let old = format!("{base}<a>b{raw} and more");
            assert_eq!(
                resumed(&old),
                enc(&old).unwrap(),
                "k = {k}: the earlier text"
            );
            let new = format!("{base}<a>b{}Z and more", &raw[..k]);
            let tail = &new[base.len()..];
            assert_eq!(resumed(&new), enc(&new).unwrap(), "k = {k}: …{tail:?}");
        }
        let after = seg.render_stats();
        assert!(
            after.hits >= before.hits + 2 * raw.len() as u64 - 1,
            "the texts resumed: {before:?} → {after:?}"
        );
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
