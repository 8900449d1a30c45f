//! Token ids read straight out of a body's `prompt` array while it is validated: the JSON
//! array of plain integers (no sign, fraction or exponent; no leading zero) that fit u32, read
//! as two stretches side by side, eight bytes an id where the id is short.
//!
//! Invariant: [`int_array`] accepts exactly the arrays, and reads exactly the ids, that the
//! one-id-after-another reading (`int_array_simple`, in the tests) does; anything else is None and
//! left to serde by the caller.

use super::skip_ws;

/// Reads the JSON array at the start of `b` (`b[0] == b'['`) when it holds only plain integers
/// (no sign, fraction or exponent; no leading zero) that fit u32: the ids and the bytes the array
/// takes. None for anything else, valid or not (serde decides).
///
/// Reading an id needs to know where the previous one ended, so one reader is a chain of
/// dependent steps that leaves the CPU waiting. The bytes are cut at the first comma past the
/// middle into two stretches read in turn, an id from each, so the two chains overlap (measured
/// 20-25% faster on 100k ids; more stretches ran out of registers). The first stretch must reach
/// that comma as a separator (or meet the array's `]` first: then the array is all its own);
/// the second then starts inside the array and must end at its `]`. Together they accept
/// exactly `[ ws id (ws , ws id)* ws ]`, as `int_array_simple` does.
pub(super) fn int_array(b: &[u8]) -> Option<(Vec<u32>, usize)> {
    empty_or(b, two_stretches)
}

/// Ids read and the offset past the array's `]`.
type Read = Option<(Vec<u32>, usize)>;

/// The empty array at `b`, or the rest of it as `rest` reads it from its first id on.
fn empty_or(b: &[u8], rest: fn(&[u8], usize) -> Read) -> Read {
    let first = skip_ws(b, 1);
    if b.get(first) == Some(&b']') {
        return Some((Vec::new(), first + 1));
    }
    rest(b, first)
}

/// The rest of an array of plain integers whose next id starts at `b[first]` (after its `[` or
/// a separator, and the whitespace after it), read as two stretches side by side (see
/// [`int_array`]): the ids up to its `]` and the offset past that. None as [`int_array`].
pub(super) fn two_stretches(b: &[u8], first: usize) -> Option<(Vec<u32>, usize)> {
    let mid = first + (b.len() - first.min(b.len())) / 2;
    let Some(stop) = b
        .get(mid..)
        .and_then(|r| r.iter().position(|&c| c == b','))
        .map(|p| mid + p)
    else {
        let mut ids = Vec::with_capacity((b.len() / 6).min(1 << 20));
        let end = read_ids(b, Next::Id(first), &mut ids, None)?;
        return Some((ids, end.1 + 1));
    };
    // A token id of a large vocabulary takes about 6 bytes ("12345,"): room for that many
    // (only the pages written are touched; at most 2 MiB each, the rest of a body may not be
    // the array); shorter ids regrow it.
    let mut head = Vec::with_capacity(((stop - first) / 6 + 1).min(1 << 19));
    let mut tail = Vec::with_capacity(((b.len() - stop) / 6 + 1).min(1 << 19));
    let (mut a, mut c) = (first, skip_ws(b, stop + 1));
    // The array's layout: `[1,2]`, or `[1, 2]` (what `json.dumps` writes) when the first
    // separator is a comma and a space. Within it the next id starts at a known distance from
    // where this one ends, so finding it waits only for this id's length, not for loads of the
    // separator (those are checked beside it); anything else leaves this loop below.
    let sp = usize::from(b.get(stop + 1) == Some(&b' ') && b.get(stop + 2) != Some(&b' '));
    let separated = |i: usize| b.get(i) == Some(&b',') && (sp == 0 || b.get(i + 1) == Some(&b' '));
    // Both stretches an id at a time while both ids are followed by the layout's separator (the
    // head's not at `stop`); an id of eight digits or more is read byte by byte in its turn.
    let (head_next, tail_next) = loop {
        let (Some((va, ia)), Some((vc, ic))) = (read_id(b, a), read_id(b, c)) else {
            // More whitespace than the layout's may come first.
            break (Next::Id(skip_ws(b, a)), Next::Id(skip_ws(b, c)));
        };
        head.push(va);
        tail.push(vc);
        if separated(ia) && ia != stop && separated(ic) {
            (a, c) = (ia + 1 + sp, ic + 1 + sp);
        } else {
            break (
                Next::Separator(skip_ws(b, ia)),
                Next::Separator(skip_ws(b, ic)),
            );
        }
    };
    match read_ids(b, head_next, &mut head, Some(stop))? {
        (Ended::Stop, _) => {}
        // The array ended before the middle: the tail read past it, dropped.
        (Ended::Array, end) => return Some((head, end + 1)),
    }
    let (_, end) = read_ids(b, tail_next, &mut tail, None)?;
    head.extend_from_slice(&tail);
    Some((head, end + 1))
}

/// Where a stretch's reading goes on from.
#[derive(Clone, Copy)]
enum Next {
    /// An id starts here.
    Id(usize),
    /// An id ended and its trailing whitespace was skipped: a separator or the `]` is here.
    Separator(usize),
}

/// What ended a stretch.
enum Ended {
    /// The comma at `stop`.
    Stop,
    /// The array's `]`.
    Array,
}

/// Reads ids from `next` on into `ids`, an id at a time, until the comma at `stop` or the
/// array's `]`: which, and its position. None: anything else comes first.
fn read_ids(
    b: &[u8],
    next: Next,
    ids: &mut Vec<u32>,
    stop: Option<usize>,
) -> Option<(Ended, usize)> {
    let mut i = match next {
        Next::Separator(i) => i,
        Next::Id(at) => {
            let (v, end) = read_id(b, at)?;
            ids.push(v);
            skip_ws(b, end)
        }
    };
    loop {
        match *b.get(i)? {
            b',' if Some(i) == stop => return Some((Ended::Stop, i)),
            b',' => {
                let (v, end) = read_id(b, skip_ws(b, i + 1))?;
                ids.push(v);
                i = skip_ws(b, end);
            }
            b']' => return Some((Ended::Array, i)),
            _ => return None,
        }
    }
}

/// The plain integer that starts at `b[at]` and where it ends: eight bytes at once where there
/// are eight and it is short, else byte by byte.
#[inline(always)]
fn read_id(b: &[u8], at: usize) -> Option<(u32, usize)> {
    match short_at(b, at) {
        Some((v, len)) => Some((v, at + len)),
        None => long_int(b, at),
    }
}

/// [`short_int`] on the eight bytes at `b[at]` (None where there are fewer).
#[inline(always)]
fn short_at(b: &[u8], at: usize) -> Option<(u32, usize)> {
    let w = <[u8; 8]>::try_from(b.get(at..at + 8)?).ok()?;
    short_int(u64::from_le_bytes(w))
}

/// The plain integer (1 to 7 digits, no leading zero) that starts the eight bytes of `w` (read
/// little endian: the first byte lowest) and its length in bytes; None when the digits run 0 or
/// 8 bytes or start with a needless zero (the byte-by-byte reading decides those). No branch on
/// the number of digits.
#[inline(always)]
fn short_int(w: u64) -> Option<(u32, usize)> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0xF0F0_F0F0_F0F0_F0F0;
    // A byte is a digit iff its high nibble is 3 before and after adding 6 ('0'..='9' are
    // 0x30..=0x39). A carry out of a byte only comes from a non-digit, and only the first
    // non-digit's position is used.
    let not_digit =
        ((w & HIGH) ^ (ONES * 0x30)) | ((w.wrapping_add(ONES * 6) & HIGH) ^ (ONES * 0x30));
    let len = (not_digit.trailing_zeros() / 8) as usize;
    if len == 0 || len == 8 || (w & 0xFF == u64::from(b'0') && len > 1) {
        return None;
    }
    // The digits moved to the top bytes, zeros below: eight digits, leading zeros first.
    let v = w.wrapping_sub(ONES * 0x30) << (8 * (8 - len));
    // Pairs, then fours, then all eight (the usual multiply-and-shift reduction).
    let v = v.wrapping_mul(10).wrapping_add(v >> 8);
    let mask = 0x0000_00FF_0000_00FF;
    let v = ((v & mask)
        .wrapping_mul(100 + (1_000_000 << 32))
        .wrapping_add(((v >> 16) & mask).wrapping_mul(1 + (10_000 << 32))))
        >> 32;
    // Seven digits at most: below 10^7, so the conversion never fails.
    Some((u32::try_from(v).ok()?, len))
}

/// The plain integer that starts at `b[i]`, read byte by byte, and where it ends: None if there
/// is none, it has a needless leading zero or it does not fit u32.
pub(super) fn long_int(b: &[u8], mut i: usize) -> Option<(u32, usize)> {
    let first = *b.get(i)?;
    let mut value = u64::from(first.wrapping_sub(b'0'));
    if value > 9 {
        return None;
    }
    let start = i;
    i += 1;
    while let Some(&c) = b.get(i) {
        let d = c.wrapping_sub(b'0');
        if d > 9 {
            break;
        }
        value = value * 10 + u64::from(d);
        i += 1;
        if i - start > 10 {
            return None; // beyond u32
        }
    }
    if first == b'0' && i - start > 1 {
        return None; // a leading zero: not JSON
    }
    Some((u32::try_from(value).ok()?, i))
}

/// The plain reading [`int_array`] must agree with: one id after another.
#[cfg(test)]
pub(super) fn int_array_simple(b: &[u8]) -> Option<(Vec<u32>, usize)> {
    let mut ids = Vec::new();
    let mut i = skip_ws(b, 1);
    if b.get(i) == Some(&b']') {
        return Some((ids, i + 1));
    }
    loop {
        let (v, end) = long_int(b, i)?;
        ids.push(v);
        i = skip_ws(b, end);
        match b.get(i)? {
            b',' => i = skip_ws(b, i + 1),
            b']' => return Some((ids, i + 1)),
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::mutate;

    /// The eight-bytes-at-once reading agrees with the byte-by-byte one wherever it answers, and
    /// answers for every id of up to 7 digits followed by what can follow one.
    #[test]
    fn eight_bytes_at_once_agree_with_byte_by_byte() {
        let mut rng = fastrand::Rng::with_seed(11);
        let alphabet = b"0123456789, ]\n\t-.e/:\xff\x00";
        let mut answered = 0;
        for _ in 0..200_000 {
            let mut w = [0u8; 8];
            for c in &mut w {
                *c = if rng.bool() {
                    b'0' + rng.u8(..10)
                } else {
                    alphabet[rng.usize(..alphabet.len())]
                };
            }
            if let Some(got) = short_int(u64::from_le_bytes(w)) {
                assert_eq!(Some(got), long_int(&w, 0), "{w:?}");
                answered += 1;
            }
        }
        assert!(answered > 10_000, "{answered}");
        for n in (0..10_000_000u32)
            .step_by(7)
            .chain([9, 99, 999_999, 9_999_999])
        {
            for tail in [&b","[..], b"]", b" ", b"\n", b", 123456"] {
                let mut w = n.to_string().into_bytes();
                let len = w.len();
                w.extend_from_slice(tail);
                w.resize(w.len().max(8), b'7');
                let word = u64::from_le_bytes(w[..8].try_into().unwrap());
                assert_eq!(short_int(word), Some((n, len)));
            }
        }
        // Eight digits, a leading zero, no digit: the byte-by-byte reading decides.
        assert_eq!(short_int(u64::from_le_bytes(*b"12345678")), None);
        assert_eq!(short_int(u64::from_le_bytes(*b"0123,   ")), None);
        assert_eq!(short_int(u64::from_le_bytes(*b",1234567")), None);
        assert_eq!(short_int(u64::from_le_bytes(*b"0,1,2,3,")), Some((0, 1)));
    }

    /// An id of 1 to 10 digits, some beyond u32.
    fn random_id(rng: &mut fastrand::Rng) -> u64 {
        match rng.u8(..10) {
            0 => rng.u64(..10),
            1 => rng.u64(..=u64::from(u32::MAX) + 10),
            _ => rng.u64(..200_000),
        }
    }

    /// The two layouts clients send (`[1,2]`, `[1, 2]`) against the plain reading: arrays in
    /// them of ids of 1 to 10 digits, followed by more of the body, half of them mutated
    /// anywhere (another separator, a sign, a fraction, a needless zero, a second space, a stray
    /// `]` or comma, a cut).
    #[test]
    fn the_usual_layouts_agree_with_one_id_after_another() {
        let mut rng = fastrand::Rng::with_seed(17);
        let mut read = 0;
        for case in 0..6_000 {
            let sep: &[u8] = if rng.bool() { b"," } else { b", " };
            let mut b = b"[".to_vec();
            for i in 0..rng.usize(1..300) {
                if i > 0 {
                    b.extend_from_slice(sep);
                }
                b.extend_from_slice(random_id(&mut rng).to_string().as_bytes());
            }
            b.push(b']');
            b.extend(std::iter::repeat_n(
                b"}, ]1"[rng.usize(..5)],
                rng.usize(..2000),
            ));
            if case % 2 == 1 {
                mutate(&mut rng, &mut b, 1, b",]- .e0\n", b"0,- ]");
            }
            let want = int_array_simple(&b);
            read += usize::from(want.is_some());
            assert_eq!(
                int_array(&b),
                want,
                "case {case}: {}",
                String::from_utf8_lossy(&b)
            );
        }
        assert!(read > 3_000, "{read}");
    }

    /// The two-stretch reading against the plain one on long arrays of every shape: separators
    /// with and without whitespace, ids of 1 to 10 digits (some beyond u32), arrays that end
    /// before, at or after the middle of what follows them, and mutations anywhere (a broken
    /// separator, a sign, a fraction, a leading zero, a cut).
    #[test]
    fn two_stretches_agree_with_one_id_after_another() {
        let mut rng = fastrand::Rng::with_seed(5);
        let (mut read, mut refused) = (0, 0);
        for case in 0..3_000 {
            let n = rng.usize(..400);
            let mut b = b"[".to_vec();
            for i in 0..n {
                if i > 0 {
                    b.extend_from_slice([&b","[..], b", ", b" ,", b"\n,\t"][rng.usize(..4)]);
                }
                b.extend_from_slice(random_id(&mut rng).to_string().as_bytes());
            }
            b.extend_from_slice([&b"]"[..], b" ]", b"\n]"][rng.usize(..3)]);
            // What follows the array: nothing, or more of the body (with commas in it).
            let rest = rng.usize(..3000);
            b.extend(std::iter::repeat_n(b"x, 1"[rng.usize(..4)], rest));
            if case % 2 == 1 {
                for _ in 0..rng.usize(1..3) {
                    mutate(&mut rng, &mut b, 1, b",]- .e0", b"0,-");
                }
            }
            let want = int_array_simple(&b);
            assert_eq!(
                int_array(&b),
                want,
                "case {case}: {}",
                String::from_utf8_lossy(&b)
            );
            if want.is_some() {
                read += 1;
            } else {
                refused += 1;
            }
        }
        assert!(
            read > 1000 && refused > 500,
            "{read} read, {refused} refused"
        );
    }
}
