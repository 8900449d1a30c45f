//! Token ids read 64 bytes a step with AVX-512, where the CPU has it (checked at run time; the
//! portable reader in [`mod@super::int_array`] does the rest).
//!
//! A step loads 64 bytes of the array and marks its digits, commas, spaces and `]` in 64-bit
//! masks. The masks alone check the array's shape: only those bytes before the `]`, an id never
//! followed by another without a comma between, no needless leading zero. Where an id ends is a
//! bit of the masks, so the ids of a step are independent of each other: their positions are
//! packed into one vector (a compress), each id's last eight bytes gathered into a 64-bit lane
//! (a two-table byte permute: this step and the one before, so an id may start in the previous
//! step), the bytes before its first digit zeroed, and eight ids converted at once by multiply-adds.
//! The portable reader instead finds where each id starts from where the one before it ended.
//!
//! It answers only for the arrays clients send: ids separated by a comma with spaces around it or
//! not (`[1,2]`, `[1, 2]`). Ids of eight digits or more are read byte by byte in their turn
//! (a lane holds eight bytes). Anything else (another whitespace, anything that is not such an
//! array) is None: "not read here", and the caller reads the array the portable way, which
//! decides.
//!
//! Invariant: where [`ids_to_end`] answers, the answer is the one-id-after-another reading's
//! (differential tests below, on a CPU that has the features: every usual array is answered,
//! anything else declined or answered alike; `int_array`'s tests run through it too).
//!
//! One of the two places in this crate with `unsafe` code (the other is `walk`'s AVX-512 string
//! lanes; `unsafe_code` is denied elsewhere): the call into the function compiled for AVX-512
//! after the CPU was checked, the loads from the body and the stores into the id vector's
//! reserved room, each with its bound next to it.
#![allow(unsafe_code)]

use super::int_array::long_int;
use std::arch::x86_64::{
    __m512i, _mm256_storeu_si256, _mm512_add_epi64, _mm512_add_epi8, _mm512_cmpeq_epi64_mask,
    _mm512_cmpeq_epi8_mask, _mm512_cmplt_epu8_mask, _mm512_cvtepi64_epi32, _mm512_loadu_si512,
    _mm512_madd_epi16, _mm512_maddubs_epi16, _mm512_maskz_compress_epi8, _mm512_maskz_loadu_epi8,
    _mm512_maskz_sub_epi8, _mm512_movm_epi8, _mm512_mul_epu32, _mm512_permutex2var_epi8,
    _mm512_permutexvar_epi8, _mm512_set1_epi16, _mm512_set1_epi32, _mm512_set1_epi64,
    _mm512_set1_epi8, _mm512_srli_epi64, _mm512_sub_epi8,
};

/// Bytes a step.
const STEP: usize = 64;

/// The ids of the array whose next id starts at `b[first]`, up to its `]`, and the offset past
/// it, as [`super::int_array::ids_to_end`] reads them; None where this reader does not answer
/// (see the module doc), or where the CPU lacks AVX-512 (F, BW, VBMI, VBMI2).
pub(super) fn ids_to_end(b: &[u8], first: usize) -> Option<(Vec<u32>, usize)> {
    if !available() {
        return None;
    }
    // SAFETY: `read` is compiled for exactly the features `available` found on this CPU.
    unsafe { read(b, first) }
}

/// Whether this CPU runs [`read`] (the standard library caches what it detects).
fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vbmi")
        && std::arch::is_x86_feature_detected!("avx512vbmi2")
        && std::arch::is_x86_feature_detected!("popcnt")
}

/// What a step's shape check carries to the next step.
#[derive(Default)]
struct Carry {
    /// 1 if the previous step's last byte was a digit (an id runs on into this step).
    digit: u64,
    /// All ones when the array so far ends in an id, not a comma (ids and commas alternate).
    parity: u64,
}

/// Where the ids of one step end, once its shape is checked.
struct Ends {
    /// Bit i: an id's last digit is byte i of the step.
    ends: u64,
    /// Where the array's `]` is in this step, if it is.
    close: Option<usize>,
}

/// Bit i: the parity of `x`'s bits 0 to i (their running parity).
#[inline(always)]
fn prefix_xor(mut x: u64) -> u64 {
    for shift in [1, 2, 4, 8, 16, 32] {
        x ^= x << shift;
    }
    x
}

/// The shape check of one step from its masks: only digits, commas, spaces before the `]` (if
/// it is in this step); every id starts after a comma (or is the array's first) and every comma
/// follows an id; no id starts with `0` followed by a digit; the array does not end in a comma.
/// `next_digit` is whether the byte after the step is a digit. None: not an array this reader
/// answers for.
#[inline(always)]
fn shape(m: &Masks, next_digit: bool, carry: &mut Carry) -> Option<Ends> {
    let close = (m.close != 0).then(|| m.close.trailing_zeros() as usize);
    let inside = close.map_or(!0, |r| (1u64 << r) - 1);
    if !(m.digit | m.comma | m.space | m.close) & inside != 0 {
        return None;
    }
    let digit = m.digit & inside;
    let comma = m.comma & inside;
    let followed = digit >> 1 | u64::from(next_digit && close.is_none()) << 63;
    let starts = digit & !(digit << 1 | carry.digit);
    // After each id or comma, the count of them so far is odd iff it was an id.
    let parity = prefix_xor(starts | comma) ^ carry.parity;
    if (starts & !parity) | (comma & parity) | (starts & m.zero & followed) != 0 {
        return None;
    }
    carry.parity = 0u64.wrapping_sub(parity >> 63);
    carry.digit = digit >> 63;
    if close.is_some() && carry.parity == 0 {
        return None; // `[..., ]` or `[,]`
    }
    Some(Ends {
        ends: digit & !followed,
        close,
    })
}

/// The byte masks of one step (bit i for byte i).
struct Masks {
    digit: u64,
    comma: u64,
    space: u64,
    close: u64,
    zero: u64,
}

/// The vectors a call uses throughout.
struct Consts {
    zero: __m512i,
    ten: __m512i,
    /// Byte i: 64 + i (the index of byte i of the current step in the two-step table).
    current: __m512i,
    /// Byte i: i / 8 (the lane a byte belongs to).
    lane: __m512i,
    /// Byte i: 7 - i % 8 (how far before an id's last digit the lane's byte i comes from).
    back: __m512i,
}

#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,popcnt")]
#[inline]
fn consts() -> Consts {
    let table = |f: fn(usize) -> usize| -> __m512i {
        let bytes: [u8; STEP] = std::array::from_fn(|i| f(i) as u8);
        // SAFETY: reads the 64 bytes of `bytes`.
        unsafe { _mm512_loadu_si512(bytes.as_ptr().cast()) }
    };
    Consts {
        zero: _mm512_set1_epi8(b'0' as i8),
        ten: _mm512_set1_epi8(10),
        current: table(|i| STEP + i),
        lane: table(|i| i / 8),
        back: table(|i| 7 - i % 8),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,popcnt")]
#[inline]
fn masks(k: &Consts, v: __m512i) -> Masks {
    Masks {
        digit: _mm512_cmplt_epu8_mask(_mm512_sub_epi8(v, k.zero), k.ten),
        comma: _mm512_cmpeq_epi8_mask(v, _mm512_set1_epi8(b',' as i8)),
        space: _mm512_cmpeq_epi8_mask(v, _mm512_set1_epi8(b' ' as i8)),
        close: _mm512_cmpeq_epi8_mask(v, _mm512_set1_epi8(b']' as i8)),
        zero: _mm512_cmpeq_epi8_mask(v, k.zero),
    }
}

/// The 64 bytes at `b[at..]`; past the end of `b`, zero bytes (which no array has).
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,popcnt")]
#[inline]
fn load(b: &[u8], at: usize) -> __m512i {
    let rest = b.len().saturating_sub(at);
    if rest >= STEP {
        // SAFETY: b[at..at + 64] is in bounds.
        unsafe { _mm512_loadu_si512(b.as_ptr().add(at).cast()) }
    } else {
        // SAFETY: only the `rest` bytes b[at..] are read (the mask's other bytes touch no
        // memory); `at <= b.len()` for the pointer.
        unsafe {
            _mm512_maskz_loadu_epi8((1u64 << rest) - 1, b.as_ptr().add(at.min(b.len())).cast())
        }
    }
}

/// Eight ids at once: lane j's value is the id whose last digit is at the table index in byte
/// `8 * group + j` of `ends` (the table: `prev` then `cur`); and the lanes, of the first `lanes`,
/// whose id has eight digits or more (their values are not read here).
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,popcnt")]
#[inline]
fn eight(
    k: &Consts,
    prev: __m512i,
    cur: __m512i,
    ends: __m512i,
    group: usize,
    lanes: usize,
) -> (__m512i, u32) {
    // Each lane's end index in all its bytes, then the eight bytes up to and including it.
    let end = _mm512_permutexvar_epi8(
        _mm512_add_epi8(k.lane, _mm512_set1_epi8((8 * group) as i8)),
        ends,
    );
    let bytes = _mm512_permutex2var_epi8(prev, _mm512_sub_epi8(end, k.back), cur);
    let digits = _mm512_cmplt_epu8_mask(_mm512_sub_epi8(bytes, k.zero), k.ten);
    let all_digits = _mm512_cmpeq_epi64_mask(_mm512_movm_epi8(digits), _mm512_set1_epi8(-1));
    // Clear each lane's bytes from its last non-digit down: what is left is the id's digits,
    // at the top of the lane (the id's last digit is byte 7).
    let mut before = !digits;
    before |= (before >> 1) & 0x7F7F_7F7F_7F7F_7F7F;
    before |= (before >> 2) & 0x3F3F_3F3F_3F3F_3F3F;
    before |= (before >> 4) & 0x0F0F_0F0F_0F0F_0F0F;
    let values = _mm512_maskz_sub_epi8(!before, bytes, k.zero);
    // Pairs of digits (x10 + 1), then fours (x100 + 1), then eight (x10000 + 1).
    let pairs = _mm512_maddubs_epi16(values, _mm512_set1_epi16(0x010A));
    let fours = _mm512_madd_epi16(pairs, _mm512_set1_epi32(0x0001_0064));
    let values = _mm512_add_epi64(
        _mm512_mul_epu32(fours, _mm512_set1_epi64(10_000)),
        _mm512_srli_epi64::<32>(fours),
    );
    (values, u32::from(all_digits) & ((1u32 << lanes) - 1))
}

/// The ids of eight digits or more among a step's (bit k of `long`: the k-th id ending in the
/// step, whose last digit is the k-th set bit of `ends`), read byte by byte into `ids[k]`. None
/// if one does not fit u32 (or has a needless zero: [`shape`] declined those already).
fn long_ids(b: &[u8], at: usize, mut ends: u64, long: u32, ids: &mut [u32]) -> Option<()> {
    for (k, id) in ids.iter_mut().enumerate() {
        let end = at + ends.trailing_zeros() as usize;
        ends &= ends.wrapping_sub(1);
        if long >> k & 1 == 1 {
            let digits = b[..=end]
                .iter()
                .rev()
                .take_while(|c| c.is_ascii_digit())
                .count();
            *id = long_int(b, end + 1 - digits)?.0;
        }
    }
    Some(())
}

/// [`ids_to_end`] on a CPU with the features.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,popcnt")]
fn read(b: &[u8], first: usize) -> Option<(Vec<u32>, usize)> {
    let k = consts();
    // An id takes about six bytes ("12345,"); at most 2^20 ids reserved up front (only the
    // pages written are touched), more as they come.
    let mut ids: Vec<u32> =
        Vec::with_capacity((b.len().saturating_sub(first) / 6 + 64).min(1 << 20));
    let mut carry = Carry::default();
    // Before the first step: the array's `[` and spaces, never digits.
    let mut prev = _mm512_set1_epi8(b' ' as i8);
    let mut at = first;
    loop {
        let cur = load(b, at);
        let next_digit = b.get(at + STEP).is_some_and(u8::is_ascii_digit);
        let step = shape(&masks(&k, cur), next_digit, &mut carry)?;
        let n = step.ends.count_ones() as usize;
        // At most 32 ids end in 64 bytes; two groups are always converted (most steps have 9
        // to 16 ids), so up to 32 lanes are stored.
        ids.reserve(32);
        let room = &mut ids.spare_capacity_mut()[..32];
        let ends = _mm512_maskz_compress_epi8(step.ends, k.current);
        let (mut group, mut long) = (0, 0u32);
        while group < 2 || 8 * group < n {
            let lanes = n.saturating_sub(8 * group).min(8);
            let (values, long_lanes) = eight(&k, prev, cur, ends, group, lanes);
            long |= long_lanes << (8 * group);
            let lane = &mut room[8 * group..8 * group + 8];
            // SAFETY: eight u32 stored into the eight slots of `lane`.
            unsafe { _mm256_storeu_si256(lane.as_mut_ptr().cast(), _mm512_cvtepi64_epi32(values)) };
            group += 1;
        }
        // SAFETY: the first n of the spare slots were just written (8 * group >= n), and
        // n <= 32 <= the room reserved.
        unsafe { ids.set_len(ids.len() + n) };
        if long != 0 {
            let from = ids.len() - n;
            long_ids(b, at, step.ends, long, &mut ids[from..])?;
        }
        if let Some(r) = step.close {
            return Some((ids, at + r + 1));
        }
        if at + STEP > b.len() {
            return None; // the body ended inside the array
        }
        prev = cur;
        at += STEP;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::body::int_array::int_array_simple;
    use crate::request::body::tests::mutate;

    /// An array of 1 to `n` ids of 1 to `digits` digits in one of the layouts clients send,
    /// then up to `tail` bytes of something else (with commas, digits and `]` in it).
    fn array(rng: &mut fastrand::Rng, n: usize, digits: u32, tail: usize) -> Vec<u8> {
        let (n, digits, tail) = (rng.usize(1..n), rng.u32(1..=digits), rng.usize(..tail));
        let sep: &[u8] = [&b","[..], b", ", b" ,", b" , "][rng.usize(..4)];
        let mut b = b"[".to_vec();
        b.extend(std::iter::repeat_n(b' ', rng.usize(..3)));
        for i in 0..n {
            if i > 0 {
                b.extend_from_slice(sep);
            }
            let id = match rng.u8(..8) {
                0 => rng.u32(..10),
                1 => 10u32.pow(digits) - 1,
                _ => {
                    let below = 10u32.pow(rng.u32(1..=digits));
                    rng.u32(..below)
                }
            };
            b.extend_from_slice(id.to_string().as_bytes());
        }
        b.extend(std::iter::repeat_n(b' ', rng.usize(..3)));
        b.push(b']');
        b.extend(std::iter::repeat_with(|| b"x,1] "[rng.usize(..5)]).take(tail));
        b
    }

    /// Whether this CPU runs the reader; says so when it does not (the test then checks nothing).
    fn runs_here() -> bool {
        let runs = available();
        if !runs {
            eprintln!("skipped: this CPU has no AVX-512 VBMI2 (the portable reader is used)");
        }
        runs
    }

    fn first(b: &[u8]) -> usize {
        crate::request::body::skip_ws(b, 1)
    }

    /// Every array of the usual layouts is read here, and read as the one-id-after-another
    /// reading reads it: arrays of 1 to 400 ids of up to nine digits (so their ids and `]` fall
    /// at every offset of a 64-byte step), with more of the body after them.
    #[test]
    fn reads_the_usual_arrays_as_one_id_after_another() {
        if !runs_here() {
            return;
        }
        let mut rng = fastrand::Rng::with_seed(3);
        for case in 0..4_000 {
            let b = array(&mut rng, 400, if case % 4 == 0 { 9 } else { 7 }, 200);
            let want = int_array_simple(&b).expect("a valid array");
            assert_eq!(
                ids_to_end(&b, first(&b)),
                Some(want),
                "case {case}: {}",
                String::from_utf8_lossy(&b)
            );
        }
        // Ids of ten digits: read up to u32's largest, not beyond it (the portable reader says so).
        let b = b"[7, 4294967295, 1000000000,3]";
        assert_eq!(
            ids_to_end(b, 1),
            Some((vec![7, u32::MAX, 1_000_000_000, 3], b.len()))
        );
        assert_eq!(ids_to_end(b"[7, 4294967296]", 1), None);
        // The `]` at each offset of the first steps, the body ending right after it.
        for pad in 0..200 {
            let mut b = b"[".to_vec();
            b.extend(std::iter::repeat_n(b' ', pad % 3));
            b.extend_from_slice(b"1234567, 7");
            b.extend(std::iter::repeat_n(b' ', pad));
            b.push(b']');
            assert_eq!(
                ids_to_end(&b, first(&b)),
                Some((vec![1_234_567, 7], b.len())),
                "pad {pad}"
            );
        }
    }

    /// Anything else is not read here or read as the one-id-after-another reading reads it:
    /// other whitespace, ids beyond u32, mutated arrays (a sign, a fraction, a needless zero, a
    /// stray comma or `]`, a cut). Some of them are still read here.
    #[test]
    fn anything_else_is_declined_or_read_alike() {
        if !runs_here() {
            return;
        }
        let mut rng = fastrand::Rng::with_seed(9);
        let (mut read, mut declined, mut valid_declined) = (0, 0, 0);
        for case in 0..6_000 {
            let mut b = array(&mut rng, 300, 9, 100);
            match case % 3 {
                0 => {
                    let at = rng.usize(1..b.len());
                    b.insert(at, b"\n\t\r"[rng.usize(..3)]);
                }
                1 => b
                    .splice(1..1, b"4294967295,".iter().copied())
                    .for_each(drop),
                _ => {
                    for _ in 0..rng.usize(1..3) {
                        mutate(&mut rng, &mut b, 1, b",]- .e0\n", b"0,-]");
                    }
                }
            }
            let want = int_array_simple(&b);
            match ids_to_end(&b, first(&b)) {
                Some(got) => {
                    assert_eq!(
                        Some(got),
                        want,
                        "case {case}: {}",
                        String::from_utf8_lossy(&b)
                    );
                    read += 1;
                }
                None => {
                    declined += 1;
                    valid_declined += usize::from(want.is_some());
                }
            }
        }
        assert!(
            read > 500 && declined > 2_000 && valid_declined > 500,
            "{read} read, {declined} declined ({valid_declined} of them valid)"
        );
    }
}
