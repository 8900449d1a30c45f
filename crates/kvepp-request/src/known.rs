//! The `messages` arrays of the last few chat requests, each with its elements' spans, so that a
//! conversation's next turn (which sends every earlier message again) walks only the messages
//! it adds: the elements that lie inside the part its array shares with a recent one, byte for
//! byte, are taken as that array's walk found them ([`crate::recent`]).
//!
//! What it owns: up to eight arrays, each held as the request body it came in (`Bytes`, shared
//! with the request, never copied) with its position, its elements' spans and their message
//! cache keys ([`ElementKeys`]: computed when [`crate::RawMessages::item_key`] is first asked
//! for one, and carried to the next turn's array for the elements it takes, so a conversation's
//! earlier messages are not hashed again). Bound: eight arrays of at most
//! [`crate::MAX_SPLIT_MESSAGES`] elements, under 64 bytes of key slot and span an element, and the
//! bodies they came in.
//!
//! Invariants: an element is taken unwalked only when it ends before the last shared byte (so
//! even a number ended by the byte after it was read alike), and the walk then resumes just
//! after it; the array's text is still checked as UTF-8 whole, so what it gives is exactly
//! [`super::walk::split_array`]'s (a differential test checks it on conversations that go on,
//! branch and are cut short, with one cache across them); a key is carried only with the
//! element whose bytes it was computed from, so a carried key is always that element's.

use std::sync::{Arc, OnceLock};

use bytes::Bytes;

use super::walk::{split_array_after, SplitArray};
use crate::recent::{Kept, Recent};

/// An array as a body held it.
#[derive(Debug)]
struct Array {
    body: Bytes,
    at: usize,
    end: usize,
    /// Its elements' spans, as offsets from `at`.
    spans: Vec<(usize, usize)>,
    keys: ElementKeys,
}

/// The message cache keys of an array's elements, one slot each, set when
/// [`crate::RawMessages::item_key`] first computes one (the key of the element's bytes:
/// [`crate::generations::ContentCache::key`]).
pub(crate) type ElementKeys = Arc<[OnceLock<u128>]>;

impl Kept for Array {
    fn text(&self) -> &[u8] {
        self.body.get(self.at..self.end).unwrap_or_default()
    }
}

/// Recent `messages` arrays (see the module doc).
#[derive(Debug, Default)]
pub struct KnownArrays {
    recent: Recent<Array>,
}

impl KnownArrays {
    /// The array at `body[at]` (`[`) as [`split_array_after`] splits it, its leading elements
    /// taken from the recent array it shares the most with; kept for the next one when split,
    /// with its elements' key slots (returned too), those of the elements taken already set
    /// where the recent array's were.
    pub(super) fn split<'b>(
        &self,
        body: &'b Bytes,
        at: usize,
        cap: usize,
    ) -> Option<(SplitArray<'b>, Option<ElementKeys>)> {
        let rest = body.get(at..)?;
        let resume = self.recent.resume(rest, |a, shared| {
            let k = a.spans.partition_point(|&(_, end)| end < shared);
            (k > 0).then_some(k)
        });
        let known = resume
            .as_ref()
            .map_or(&[][..], |r| &r.from.spans[..r.usable]);
        let split = split_array_after(body, at, cap, known)?;
        let Some(spans) = &split.spans else {
            return Some((split, None));
        };
        let keys: ElementKeys = (0..spans.len()).map(|_| OnceLock::new()).collect();
        if let Some(r) = &resume {
            for (slot, from) in keys
                .iter()
                .zip(r.from.keys.get(..r.usable).unwrap_or_default())
            {
                if let Some(&k) = from.get() {
                    let _ = slot.set(k);
                }
            }
        }
        let array = Array {
            body: body.clone(),
            at,
            end: split.end,
            spans: spans.clone(),
            keys: keys.clone(),
        };
        self.recent.remember(resume.as_ref(), array);
        Some((split, Some(keys)))
    }

    /// Arrays that resumed from a recent one (hits) and long ones that could not (misses).
    #[cfg(test)]
    pub fn stats(&self) -> crate::generations::CacheStats {
        self.recent.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generations::ContentCache;
    use crate::{parse_body, parse_body_owned, ParsedBody};

    /// What a parse gives that the walk decides: the messages' element texts, or the error.
    fn seen(p: Result<ParsedBody<'_>, crate::BodyError>) -> Result<Vec<String>, String> {
        match p {
            Ok(p) => Ok(p
                .messages
                .and_then(|m| m.items)
                .unwrap_or_default()
                .iter()
                .map(|r| r.get().to_owned())
                .collect()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// A message of about `len` bytes of content, escapes and non-ASCII among them.
    fn message(rng: &mut fastrand::Rng, len: usize) -> String {
        const WORDS: &[&str] = &["tokens ", "KV\\n", "é ", "\\\"q\\\" ", "123 ", "cache\\t"];
        let mut content = String::new();
        while content.len() < len {
            content.push_str(WORDS[rng.usize(..WORDS.len())]);
        }
        let role = ["user", "assistant", "system"][rng.usize(..3)];
        format!(r#"{{"role":"{role}","content":"{content}"}}"#)
    }

    #[test]
    fn resumed_arrays_split_as_the_walk_does() {
        let known = KnownArrays::default();
        let mut carried = 0;
        let mut rng = fastrand::Rng::with_seed(9);
        let mut convs: Vec<Vec<String>> = vec![vec![message(&mut rng, 6000)]; 3];
        for step in 0..300 {
            let k = rng.usize(..convs.len());
            // Go on, branch from an earlier turn, or drop the last message.
            match rng.u8(..10) {
                0 => {
                    let keep = rng.usize(..=convs[k].len());
                    convs[k].truncate(keep.max(1));
                }
                1 => {
                    convs[k].pop();
                }
                _ => {}
            }
            let len = rng.usize(1..400);
            convs[k].push(message(&mut rng, len));
            let mut elements = convs[k].join(if k.is_multiple_of(2) { "," } else { " ,\n " });
            // Now and then: a number element (its digits may go on in the next body) or bytes
            // that break the array after the common part.
            match rng.u8(..12) {
                0 => elements.push_str(",12"),
                1 => elements.push_str(",123]x"),
                2 => elements.push_str(",{\"role\":"),
                3 => elements.push_str(",\"\\u00e9\\x\""),
                _ => {}
            }
            let body = format!(r#"{{"model":"m","messages":[{elements}],"max_tokens":5}}"#);
            let bytes = Bytes::from(body.into_bytes());
            let want = seen(parse_body(&bytes));
            let parsed = parse_body_owned(&bytes, None, &known);
            // Keys carried from an earlier turn are the keys of these very elements; the rest
            // are computed when asked for, as the tokenizer asks, and kept.
            if let Some(m) = parsed.as_ref().ok().and_then(|p| p.messages.as_ref()) {
                if let (Some(items), Some(keys)) = (&m.items, &m.keys) {
                    assert_eq!(items.len(), keys.len(), "step {step}");
                    for (i, (item, slot)) in items.iter().zip(keys.iter()).enumerate() {
                        let key = ContentCache::<()>::key(item.get().as_bytes());
                        if let Some(&k) = slot.get() {
                            assert_eq!(k, key, "step {step}: a carried key");
                            carried += 1;
                        }
                        assert_eq!(m.item_key(i), Some(key), "step {step}");
                        assert_eq!(slot.get(), Some(&key), "step {step}: kept");
                    }
                }
            }
            let got = seen(parsed);
            assert_eq!(got, want, "step {step}");
            // The same body with a raw tab (not allowed in a JSON string) late in its last
            // message, at the same length: the elements after the common part are walked.
            if let Some(i) = bytes.iter().rposition(|&b| b == b'K') {
                let mut bad = bytes.to_vec();
                bad[i] = b'\t';
                let bad = Bytes::from(bad);
                let want = seen(parse_body(&bad));
                assert!(want.is_err(), "step {step}: a raw tab");
                assert_eq!(
                    seen(parse_body_owned(&bad, None, &known)),
                    want,
                    "step {step}"
                );
            }
        }
        let s = known.stats();
        assert!(s.hits > 200, "most arrays resumed: {s:?}");
        assert!(carried > 1000, "earlier messages' keys carried: {carried}");
    }
}
