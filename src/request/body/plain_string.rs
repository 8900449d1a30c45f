//! A JSON string value read without serde when it is plain: no escape and no control character
//! before its closing quote, valid UTF-8. That is the usual shape of a long completions `prompt`,
//! and the body scan's costliest value: serde's string scan looks at each 8-byte word for three
//! byte classes in turn (about 2.4 instructions a byte under callgrind), then the raw value's
//! UTF-8 is checked. Here each 32-byte step is tested for the three classes with vector compares
//! (about one instruction a byte), then UTF-8 is checked as before.
//!
//! Invariant: [`plain_string`] answers only for strings serde accepts, with the text and the end
//! serde gives them; anything else (an escape, a control character, bad UTF-8, no closing quote)
//! is None and left to serde, whose error it is.

/// Bytes examined per step: two 16-byte vectors' worth.
const STEP: usize = 32;

/// What ends a plain string's scan: its closing quote, or a byte it may not hold unescaped.
#[inline(always)]
fn special(c: u8) -> bool {
    c == b'"' || c == b'\\' || c < 0x20
}

/// Whether a step holds a [`special`] byte. One fold per byte class, each with no early exit and
/// a byte-wide accumulator: the compiler makes each a vector compare and a mask (about one
/// instruction a byte in all); folding the three classes at once, or over `bool`, stays scalar.
#[inline(always)]
fn has_special(step: &[u8; STEP]) -> bool {
    let quote = step.iter().fold(0u8, |m, &c| m | u8::from(c == b'"'));
    let backslash = step.iter().fold(0u8, |m, &c| m | u8::from(c == b'\\'));
    let control = step.iter().fold(0u8, |m, &c| m | u8::from(c < 0x20));
    (quote | backslash | control) != 0
}

/// The string value at `b[at]` when it is plain: its JSON text (quotes included) and the offset
/// just past it. None when `b[at]` is not `"` or the string is not plain.
pub(super) fn plain_string(b: &[u8], at: usize) -> Option<(&str, usize)> {
    if b.get(at) != Some(&b'"') {
        return None;
    }
    let start = at + 1;
    let rest = b.get(start..)?;
    let mut steps = rest.chunks_exact(STEP);
    let mut offset = 0;
    let found = loop {
        let Some(step) = steps.next() else {
            // The last, shorter step.
            break steps.remainder().iter().position(|&c| special(c));
        };
        // Always STEP bytes (`chunks_exact`); as an array the compiler sees it.
        if has_special(<&[u8; STEP]>::try_from(step).ok()?) {
            break step.iter().position(|&c| special(c));
        }
        offset += STEP;
    };
    let close = start + offset + found?;
    if b[close] != b'"' {
        return None;
    }
    let text = std::str::from_utf8(&b[at..=close]).ok()?;
    Some((text, close + 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::value::RawValue;

    /// serde's answer for the value at `b[at]`: its raw text and where it ends.
    fn serde_at(b: &[u8], at: usize) -> Option<(String, usize)> {
        let mut values = serde_json::Deserializer::from_slice(&b[at..]).into_iter::<&RawValue>();
        match values.next() {
            Some(Ok(v)) => Some((v.get().to_owned(), at + values.byte_offset())),
            _ => None,
        }
    }

    /// Random strings around the step's boundaries, of every byte class: plain ASCII, multi-byte
    /// UTF-8, escapes, control characters, stray continuation bytes, a missing closing quote.
    #[test]
    fn agrees_with_serde_on_strings_of_every_kind() {
        let pieces: [&[u8]; 12] = [
            b"a",
            b"quick brown fox ",
            "é".as_bytes(),
            "漢字".as_bytes(),
            "🦀".as_bytes(),
            b"\\n",
            b"\\\"",
            b"\\u00e9",
            b"\x01",
            b"\x1f",
            b"\x7f",
            b"\x80",
        ];
        let mut rng = fastrand::Rng::with_seed(38);
        let (mut plain, mut cases) = (0, 0);
        for _ in 0..20_000 {
            let mut body = b"  ".to_vec();
            let at = body.len();
            body.push(b'"');
            let target = rng.usize(0..3 * STEP + 5);
            // Mostly plain text; now and then a piece of another class.
            while body.len() < at + 1 + target {
                let p = if rng.u8(..) < 245 {
                    &pieces[rng.usize(0..2)]
                } else {
                    &pieces[rng.usize(..pieces.len())]
                };
                body.extend_from_slice(p);
            }
            if rng.u8(..) < 250 {
                body.push(b'"');
            }
            body.extend_from_slice(b" , 1");
            cases += 1;
            let ours = plain_string(&body, at);
            let theirs = serde_at(&body, at);
            match ours {
                Some((text, end)) => {
                    plain += 1;
                    assert_eq!(theirs, Some((text.to_owned(), end)), "{body:?}");
                }
                // Not plain: an escape, a control character, bad UTF-8 or no closing quote.
                None => {
                    let inner = theirs.as_ref().map(|(t, _)| &t.as_bytes()[1..t.len() - 1]);
                    assert!(
                        inner.is_none_or(|s| s.iter().any(|&c| c == b'\\' || c < 0x20)),
                        "serde read a plain string that was not: {body:?}"
                    );
                }
            }
        }
        assert!(plain * 4 > cases, "{plain} of {cases} plain");
        assert!(plain * 10 < cases * 9, "{plain} of {cases} plain");
    }

    #[test]
    fn only_a_string_is_read() {
        assert_eq!(plain_string(b"[\"a\"]", 0), None);
        assert_eq!(plain_string(b"\"a\"", 1), None);
        assert_eq!(plain_string(b"\"\"", 0), Some(("\"\"", 2)));
        assert_eq!(plain_string(b"x\"ab\"y", 1), Some(("\"ab\"", 5)));
        assert_eq!(plain_string(b"\"ab", 0), None);
    }
}
