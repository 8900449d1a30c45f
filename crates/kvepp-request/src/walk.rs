//! JSON values skipped (validated, not built) without serde, strings 64 bytes a step: each step
//! marks its quotes, backslashes and control characters in one 64-bit mask (SSE2 compares and
//! movemasks, 16 bytes at a time), and every hit in the mask is dealt with before the next step.
//! That is what makes strings with dense escapes cheap (a chat's content has a `\n` every few
//! dozen bytes, where serde's scan restarts its 8-byte words after every escape).
//!
//! It answers for JSON as RFC 8259 writes it, nested up to [`MAX_DEPTH`] levels. Anything it does
//! not accept (an error anywhere, or deeper nesting) is None and left to serde, whose answer and
//! error message it is. UTF-8 is not checked while walking: the caller checks a value's whole
//! text once ([`utf8`]; every structural byte is ASCII, so that is the check serde makes of each
//! raw value).
//!
//! Invariant: where [`skip_value`] or [`split_array`] answer, serde_json accepts the same bytes
//! as one value (once their UTF-8 is valid), ending where they say, with the same elements
//! (`tests`, differential on generated and mutated JSON).

use super::{skip_ws, RawJson};

/// Nesting deeper than this is left to serde (whose own limit is 128).
pub(super) const MAX_DEPTH: usize = 64;

/// Bytes examined per string step; a string's first step takes [`FIRST`] (most keys and short
/// values end within it).
const LANE: usize = 64;
const FIRST: usize = 16;

/// Bit `i` set where byte `i` of the 16 ends a string's plain run: `"`, `\` or a control
/// character (below 0x20). SSE2: three compares and one movemask.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn specials16(v: &[u8; 16]) -> u64 {
    use safe_arch::{
        bitor_m128i, cmp_eq_mask_i8_m128i, m128i, min_u8_m128i, move_mask_i8_m128i,
        set_splat_i8_m128i,
    };
    let x = m128i::from(*v);
    // Below 0x20 (unsigned): min(x, 0x1F) == x.
    let control = cmp_eq_mask_i8_m128i(min_u8_m128i(x, set_splat_i8_m128i(0x1F)), x);
    let hits = bitor_m128i(
        bitor_m128i(
            cmp_eq_mask_i8_m128i(x, set_splat_i8_m128i(b'"' as i8)),
            cmp_eq_mask_i8_m128i(x, set_splat_i8_m128i(b'\\' as i8)),
        ),
        control,
    );
    u64::from(move_mask_i8_m128i(hits) as u16)
}

/// [`specials16`] byte by byte, of any width up to 64: the reference, and the reading on other
/// targets.
#[cfg(any(test, not(target_arch = "x86_64")))]
fn specials_simple(v: &[u8]) -> u64 {
    v.iter().enumerate().fold(0, |m, (i, &c)| {
        m | u64::from(c == b'"' || c == b'\\' || c < 0x20) << i
    })
}

#[cfg(not(target_arch = "x86_64"))]
fn specials16(v: &[u8; 16]) -> u64 {
    specials_simple(v)
}

/// [`specials16`] of a lane's four 16-byte parts, as one mask.
#[inline(always)]
fn specials(lane: &[u8; LANE]) -> u64 {
    let mut m = 0;
    for (j, v) in lane.chunks_exact(16).enumerate() {
        let mut part = [0u8; 16];
        part.copy_from_slice(v);
        m |= specials16(&part) << (16 * j);
    }
    m
}

/// Where a string's scan goes after a step.
enum Step {
    /// Its closing quote ends here (the offset past it).
    End(usize),
    /// The next step starts here.
    At(usize),
}

/// Deals with every hit `m` of the step of `width` bytes at `b[i]`. An escape that ends within the
/// step only clears the bits before its end (its own letter may be a `"` or `\\`).
#[inline(always)]
fn step(b: &[u8], i: usize, width: usize, mut m: u64) -> Option<Step> {
    while m != 0 {
        let hit = i + m.trailing_zeros() as usize;
        match b[hit] {
            b'"' => return Some(Step::End(hit + 1)),
            b'\\' => {
                let next = skip_escape(b, hit + 1)?;
                if next >= i + width {
                    return Some(Step::At(next));
                }
                m &= u64::MAX << (next - i);
            }
            _ => return None,
        }
    }
    Some(Step::At(i + width))
}

/// The string at `b[at]` (`b[at] == b'"'`): the offset just past its closing quote. None: no
/// closing quote, a control character, or an escape JSON does not have. Its first 16 bytes
/// (where most keys and short values end) are marked in one 16-byte part, the rest a 64-byte
/// lane at a time ([`specials`]).
fn skip_string(b: &[u8], at: usize) -> Option<usize> {
    let mut i = at + 1;
    if let Some(first) = b.get(i..i + FIRST) {
        match step(
            b,
            i,
            FIRST,
            specials16(<&[u8; FIRST]>::try_from(first).ok()?),
        )? {
            Step::End(end) => return Some(end),
            Step::At(next) => i = next,
        }
    }
    loop {
        let Some(lane) = b.get(i..i + LANE) else {
            return skip_string_tail(b, i);
        };
        match step(b, i, LANE, specials(<&[u8; LANE]>::try_from(lane).ok()?))? {
            Step::End(end) => return Some(end),
            Step::At(next) => i = next,
        }
    }
}

/// [`skip_string`] from `b[i]` on, where fewer than a lane's bytes are left: byte by byte.
fn skip_string_tail(b: &[u8], mut i: usize) -> Option<usize> {
    loop {
        match *b.get(i)? {
            b'"' => return Some(i + 1),
            b'\\' => i = skip_escape(b, i + 1)?,
            c if c < 0x20 => return None,
            _ => i += 1,
        }
    }
}

/// The escape whose letter is at `b[at]` (just after its backslash): the offset past it.
#[inline(always)]
fn skip_escape(b: &[u8], at: usize) -> Option<usize> {
    match *b.get(at)? {
        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Some(at + 1),
        b'u' => b
            .get(at + 1..at + 5)?
            .iter()
            .all(u8::is_ascii_hexdigit)
            .then_some(at + 5),
        _ => None,
    }
}

/// The digits at `b[at]`: the offset past them, None if there is none.
fn skip_digits(b: &[u8], at: usize) -> Option<usize> {
    let n = b
        .get(at..)?
        .iter()
        .take_while(|c| c.is_ascii_digit())
        .count();
    (n > 0).then_some(at + n)
}

/// The number at `b[at]`: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`.
fn skip_number(b: &[u8], at: usize) -> Option<usize> {
    let mut i = at + usize::from(b.get(at) == Some(&b'-'));
    i = match *b.get(i)? {
        // One zero only: a digit after it is rejected by whatever reads on (a container wants
        // `,` or its end; a value alone, a delimiter).
        b'0' => i + 1,
        _ => skip_digits(b, i)?,
    };
    if b.get(i) == Some(&b'.') {
        i = skip_digits(b, i + 1)?;
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        i = skip_digits(b, i)?;
    }
    Some(i)
}

/// `b` as text when it is valid UTF-8 (SIMD-checked: the same answer as `std::str::from_utf8`,
/// several times faster on long text).
pub(super) fn utf8(b: &[u8]) -> Option<&str> {
    simdutf8::basic::from_utf8(b).ok()
}

/// The value at `b[at]` (no whitespace before it): the offset just past it. As serde reads a value
/// out of a stream, a number or a literal must end where whitespace, a structural byte or the
/// input does.
pub(super) fn skip_value(b: &[u8], at: usize) -> Option<usize> {
    let end = value(b, at, 0)?;
    let delimited = matches!(b.get(at), Some(b'"' | b'[' | b'{'))
        || matches!(
            b.get(end),
            None | Some(
                b' ' | b'\n' | b'\t' | b'\r' | b'"' | b'[' | b']' | b'{' | b'}' | b',' | b':'
            )
        );
    delimited.then_some(end)
}

fn value(b: &[u8], at: usize, depth: usize) -> Option<usize> {
    match *b.get(at)? {
        b'"' => skip_string(b, at),
        b'{' if depth < MAX_DEPTH => object(b, at, depth + 1),
        b'[' if depth < MAX_DEPTH => array(b, at, depth + 1, |_, _| {}),
        b't' => literal(b, at, b"true"),
        b'f' => literal(b, at, b"false"),
        b'n' => literal(b, at, b"null"),
        b'-' | b'0'..=b'9' => skip_number(b, at),
        _ => None,
    }
}

fn literal(b: &[u8], at: usize, word: &[u8]) -> Option<usize> {
    (b.get(at..at + word.len())? == word).then_some(at + word.len())
}

/// The object at `b[at]` (`{`), members nested at `depth`.
fn object(b: &[u8], at: usize, depth: usize) -> Option<usize> {
    let mut i = skip_ws(b, at + 1);
    if b.get(i) == Some(&b'}') {
        return Some(i + 1);
    }
    loop {
        if b.get(i) != Some(&b'"') {
            return None;
        }
        i = skip_ws(b, skip_string(b, i)?);
        if b.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(b, value(b, skip_ws(b, i + 1), depth)?);
        match *b.get(i)? {
            b',' => i = skip_ws(b, i + 1),
            b'}' => return Some(i + 1),
            _ => return None,
        }
    }
}

/// The array at `b[at]` (`[`), elements nested at `depth`; `each` sees every element's span.
fn array(b: &[u8], at: usize, depth: usize, mut each: impl FnMut(usize, usize)) -> Option<usize> {
    let i = skip_ws(b, at + 1);
    if b.get(i) == Some(&b']') {
        return Some(i + 1);
    }
    let end = value(b, i, depth)?;
    each(i, end);
    array_after(b, end, depth, each)
}

/// The rest of an array after an element that ends at `end` (elements nested at `depth`): the
/// offset just past its `]`; `each` sees every further element's span.
fn array_after(
    b: &[u8],
    mut end: usize,
    depth: usize,
    mut each: impl FnMut(usize, usize),
) -> Option<usize> {
    loop {
        let i = skip_ws(b, end);
        match *b.get(i)? {
            b',' => {
                let start = skip_ws(b, i + 1);
                end = value(b, start, depth)?;
                each(start, end);
            }
            b']' => return Some(i + 1),
            _ => return None,
        }
    }
}

/// The array at `b[at]` (`b[at] == b'['`) as serde splits it into raw elements: their texts
/// when there are at most `cap` (None beyond: validated only), and the offset just past it.
/// None: the walk cannot tell (invalid, too deep, or not UTF-8); serde decides.
pub(super) fn split_array(
    b: &[u8],
    at: usize,
    cap: usize,
) -> Option<(Option<Vec<RawJson<'_>>>, usize)> {
    split_array_after(b, at, cap, &[]).and_then(split_items)
}

/// An array as [`split_array_after`] split it.
pub(super) struct SplitArray<'b> {
    /// The array's text.
    pub text: &'b str,
    /// Its elements' spans (offsets into `text`); None beyond the cap.
    pub spans: Option<Vec<(usize, usize)>>,
    /// The offset just past it.
    pub end: usize,
}

/// [`split_array_after`]'s answer as [`split_array`]'s: the elements' texts (None beyond the
/// cap) and the offset just past the array.
pub(super) fn split_items(
    SplitArray { text, spans, end }: SplitArray<'_>,
) -> Option<(Option<Vec<RawJson<'_>>>, usize)> {
    let Some(spans) = spans else {
        return Some((None, end));
    };
    // Every span starts and ends at an ASCII byte of `text`: char boundaries.
    let items = spans
        .iter()
        .map(|&(s, e)| text.get(s..e).map(RawJson))
        .collect::<Option<Vec<_>>>()?;
    Some((Some(items), end))
}

/// [`split_array`] as a [`SplitArray`], the walk taking `known` (the spans of the array's first
/// elements, each ending before a byte known to be what the walk saw there) as they are and
/// resuming after the last of them.
pub(super) fn split_array_after<'b>(
    b: &'b [u8],
    at: usize,
    cap: usize,
    known: &[(usize, usize)],
) -> Option<SplitArray<'b>> {
    let mut spans: Vec<(usize, usize)> = known.to_vec();
    let mut n = known.len();
    let each = |start: usize, end: usize| {
        if n < cap {
            spans.push((start - at, end - at));
        }
        n += 1;
    };
    let end = match known.last() {
        Some(&(_, e)) => array_after(b, at + e, 1, each)?,
        None => array(b, at, 1, each)?,
    };
    Some(SplitArray {
        text: utf8(&b[at..end])?,
        spans: (n <= cap).then_some(spans),
        end,
    })
}

#[cfg(test)]
mod tests;
