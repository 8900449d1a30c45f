//! Token-id prompts read a chunk at a time, each chunk's ids remembered by its text, so that a
//! conversation's next turn (which sends every earlier id again) reads only what it adds.
//!
//! A `prompt` array of ids is cut in the body's own text: a chunk runs from just after the
//! array's `[` (or after the comma that ended the chunk before) up to the first comma at least
//! [`CHUNK_BYTES`] on. Where it is cut depends only on the bytes before, so two prompts that
//! start alike are cut alike, and a chunk's ids depend on its text alone. They are kept in a
//! bounded cache keyed by the text's xxh3-128 ([`ContentCache`], as the tokenizer's segments
//! are). The leading chunks a prompt shares with one seen before come from the cache without a
//! digit being read; from the first chunk the cache does not hold, the rest of the array is read
//! as before ([`super::int_array::two_stretches`]) and its chunks are remembered. The ids go on as
//! the pieces they were found in: the cache's own allocations, which the core's prompt memo
//! compares by address ([`kvepp_core::Prompt::TokenIdPieces`]), so the next turn's block hashes
//! are reused without its ids being compared either.
//!
//! A prompt whose first chunk the cache does not hold (a first sight) has only that chunk
//! remembered, and its ids go on as the one array they were read into: a stream of prompts that
//! never repeat (batch inference) costs a lookup and one chunk's hash and copy more than reading
//! them, not a pass over the text and a copy of every id. Should its start come again (the
//! conversation's next turn, another sample of the same prompt, a long shared system prompt),
//! that prompt's chunks are all remembered, and from the turn after on only the new ids are read.
//!
//! Invariants: the ids it gives, and whether it gives any, are exactly [`super::int_array()`]'s (a
//! differential test checks it on prompts that share prefixes, mutated ones among them, with one
//! cache across them); a chunk is remembered only after its text was read as plain ids ending at
//! a comma of the array; the cache holds at most its capacity in ids (each entry counted
//! [`ENTRY_OVERHEAD_IDS`] more). Equal hashes are taken for equal text, as the segment cache
//! does: a collision could change only where its request is routed, never what is sent to the
//! model server (the body goes on untouched).

use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;

use super::int_array::two_stretches;
use super::{skip_ws, RawPrompt};
use crate::generations::ContentCache;

/// A chunk's text runs from its start to the first comma at least this many bytes on (~1,200 ids
/// of a large vocabulary): a 100k-token prompt is ~80 lookups, and a new turn reads at most this
/// many bytes more than it adds.
pub const CHUNK_BYTES: usize = if cfg!(test) { 8 } else { 8 << 10 };

/// Ids the request path's chunk cache holds at most (16 MiB; the tokenizer's segment cache holds
/// as many per model).
pub const ID_CHUNK_CACHE_IDS: usize = 4 << 20;

/// What a remembered chunk weighs beyond its ids (key, table slot, allocation).
const ENTRY_OVERHEAD_IDS: usize = 16;

/// The cache of chunks of token-id prompts, and the counts of ids by where they came from.
#[derive(Debug)]
pub struct IdChunks {
    cache: ContentCache<Arc<[u32]>>,
    /// Ids taken from remembered chunks, and ids read from bodies
    /// (`kvepp_prompt_token_ids_total{source}`).
    cached: Counter,
    read: Counter,
}

impl IdChunks {
    /// A cache of at most `capacity` ids, counting into two counters of its own (see
    /// [`Self::counting_into`]).
    pub fn new(capacity: usize) -> Self {
        IdChunks {
            cache: ContentCache::new(capacity, ENTRY_OVERHEAD_IDS),
            cached: Counter::default(),
            read: Counter::default(),
        }
    }

    /// Counts ids taken from the cache into `cached` and ids read from bodies into `read`.
    pub fn counting_into(mut self, cached: Counter, read: Counter) -> Self {
        (self.cached, self.read) = (cached, read);
        self
    }

    /// Reads the JSON array at the start of `b` (`b[0] == b'['`) as [`super::int_array()`] does:
    /// the ids as the chunks they were found in (leading chunks from the cache), or as one array
    /// when the cache held none of them; and the bytes the array takes. None where `int_array`
    /// is None.
    pub(super) fn read(&self, b: &[u8]) -> Option<(RawPrompt<'static>, usize)> {
        let first = skip_ws(b, 1);
        if b.get(first) == Some(&b']') {
            return Some((RawPrompt::Ids(Vec::new()), first + 1));
        }
        let mut pieces = Vec::new();
        // Where the next chunk's text starts. A text the cache holds was read as plain ids
        // followed by a comma, as this one is: so it holds no `]` and its ids are those.
        let mut at = 1;
        let mut cached = 0;
        while let Some(comma) = comma_from(b, at + CHUNK_BYTES) {
            let Some(ids) = self.cache.get(&b[at..comma]) else {
                break;
            };
            cached += ids.len();
            pieces.push(ids);
            at = comma + 1;
        }
        let (rest, end) = two_stretches(b, skip_ws(b, at))?;
        self.cached.inc_by(cached as u64);
        self.read.inc_by(rest.len() as u64);
        // The rest's chunks that end at a comma of the array (before its `]` at `end - 1`);
        // every comma in the array separates two of its ids.
        let array = &b[..end - 1];
        let chunk = |at: usize| {
            let comma = comma_from(array, at + CHUNK_BYTES)?;
            Some((comma, 1 + commas(&b[at..comma])))
        };
        if pieces.is_empty() {
            // A first sight: only its first chunk is remembered (should it come again, the rest
            // will be), and the ids go on in the array they were read into, not copied.
            if let Some((comma, n)) = chunk(at) {
                self.cache.insert(&b[at..comma], rest.get(..n)?.into(), n);
            }
            return Some((RawPrompt::Ids(rest), end));
        }
        let mut from = 0;
        while let Some((comma, n)) = chunk(at) {
            let ids: Arc<[u32]> = rest.get(from..from + n)?.into();
            self.cache.insert(&b[at..comma], ids.clone(), n);
            pieces.push(ids);
            (from, at) = (from + n, comma + 1);
        }
        pieces.push(rest.get(from..)?.into());
        Some((RawPrompt::IdPieces(pieces), end))
    }
}

/// The commas in `t`: 16 bytes a step, a byte counter per lane position summed every 255 steps.
#[cfg(target_arch = "x86_64")]
fn commas(t: &[u8]) -> usize {
    use safe_arch::{
        cmp_eq_mask_i8_m128i, m128i, set_splat_i8_m128i, sub_i8_m128i, sum_of_u8_abs_diff_m128i,
        zeroed_m128i,
    };
    let comma = set_splat_i8_m128i(b',' as i8);
    let mut lanes = t.chunks_exact(16);
    let mut total = 0;
    loop {
        let mut counts = zeroed_m128i();
        let mut steps = 0;
        for lane in lanes.by_ref().take(255) {
            let mut v = [0u8; 16];
            v.copy_from_slice(lane);
            // A comma's lane compares as -1: subtracting it counts one.
            counts = sub_i8_m128i(counts, cmp_eq_mask_i8_m128i(m128i::from(v), comma));
            steps += 1;
        }
        if steps == 0 {
            break;
        }
        let [lo, hi]: [u64; 2] = sum_of_u8_abs_diff_m128i(counts, zeroed_m128i()).into();
        total += (lo + hi) as usize;
    }
    total + commas_simple(lanes.remainder())
}

/// [`commas`] byte by byte: the reference, its last bytes (fewer than 16), and the count on other
/// targets.
fn commas_simple(t: &[u8]) -> usize {
    t.iter().filter(|&&c| c == b',').count()
}

#[cfg(not(target_arch = "x86_64"))]
fn commas(t: &[u8]) -> usize {
    commas_simple(t)
}

/// The offset of the first comma at or after `b[from]`.
fn comma_from(b: &[u8], from: usize) -> Option<usize> {
    Some(from + b.get(from..)?.iter().position(|&c| c == b',')?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::int_array::int_array;
    use crate::tests::mutate;

    /// The array's ids, flattened.
    fn flat(read: Option<(RawPrompt<'_>, usize)>) -> Option<(Vec<u32>, usize)> {
        read.map(|(prompt, n)| match prompt {
            RawPrompt::Ids(ids) => (ids, n),
            RawPrompt::IdPieces(pieces) => (pieces.concat(), n),
            RawPrompt::Json(j) => panic!("not ids: {j:?}"),
        })
    }

    /// The pieces of a reading (none when it came as one array).
    fn pieces(read: &Option<(RawPrompt<'_>, usize)>) -> Vec<Arc<[u32]>> {
        match read {
            Some((RawPrompt::IdPieces(p), _)) => p.clone(),
            _ => Vec::new(),
        }
    }

    /// The vector count agrees with the plain one at every length around its steps and groups.
    #[test]
    fn commas_counted_as_byte_by_byte() {
        let mut rng = fastrand::Rng::with_seed(4);
        for len in (0..100).chain([4079, 4080, 4081, 4096, 9000, 70_000]) {
            let t: Vec<u8> = (0..len).map(|_| b",,1 ]"[rng.usize(..5)]).collect();
            assert_eq!(commas(&t), commas_simple(&t), "{len}");
        }
        let all = vec![b','; 20_000];
        assert_eq!(commas(&all), 20_000);
    }

    /// Prompts that share prefixes of every length with earlier ones (a conversation's turns, a
    /// shared start), in both layouts clients send, half of them mutated anywhere (a broken
    /// separator, a sign, a fraction, a needless zero, a stray `]`, a cut): the chunked reading
    /// with one cache across them gives exactly `int_array`'s ids and length, and reads from the
    /// cache where a prompt repeats.
    #[test]
    fn chunked_reading_agrees_with_int_array_across_prompts() {
        let mut rng = fastrand::Rng::with_seed(21);
        let chunks = IdChunks::new(4_096);
        let mut earlier: Vec<Vec<u32>> = vec![(0..50).collect()];
        let (mut read, mut from_cache) = (0, 0);
        for case in 0..4_000 {
            let base = &earlier[rng.usize(..earlier.len())];
            let mut ids = base[..rng.usize(..=base.len())].to_vec();
            ids.extend((0..rng.usize(..30)).map(|_| rng.u32(..100_000)));
            let sep: &[u8] = [&b","[..], b", ", b" , "][rng.usize(..3)];
            let mut b = [&b"["[..], b" ", b"\n"][rng.usize(..3)].to_vec();
            for (i, id) in ids.iter().enumerate() {
                if i > 0 {
                    b.extend_from_slice(sep);
                }
                b.extend_from_slice(id.to_string().as_bytes());
            }
            b.extend_from_slice(b"], \"x\": [1, 2]}");
            if case % 2 == 1 {
                mutate(&mut rng, &mut b, 1, b",]- .e0\n", b"0,- ]");
            }
            let want = int_array(&b);
            let before = chunks.cached.get();
            let got = chunks.read(&b);
            from_cache += usize::from(chunks.cached.get() > before);
            assert!(pieces(&got).iter().all(|p| !p.is_empty()));
            let got = flat(got);
            assert_eq!(got, want, "case {case}: {}", String::from_utf8_lossy(&b));
            if got.is_some() {
                read += 1;
                earlier.push(ids);
            }
        }
        assert!(
            read > 1_500 && from_cache > 1_000,
            "{read} read, {from_cache} from the cache"
        );
    }

    /// A prompt seen once has its first chunk remembered and goes on as one array; seen twice,
    /// its other chunks are remembered; from then on it comes from the cache but for its last
    /// chunk, as the same allocations. A cache too small for it still reads it right.
    #[test]
    fn a_repeated_prompt_reads_only_its_last_chunk() {
        // Chunks of at least 8 bytes ("0, 1, 2, 3" then "4, 5, 6" ...) to the first comma after.
        let body = format!(
            "[{}]",
            (0..41)
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
        let b = body.as_bytes();
        let chunks = IdChunks::new(4_096);
        let counts = || (chunks.read.get(), chunks.cached.get());
        let first = chunks.read(b);
        assert!(matches!(first, Some((RawPrompt::Ids(_), n)) if n == body.len()));
        assert_eq!(counts(), (41, 0));
        let second = chunks.read(b);
        let head = pieces(&second)[0].len() as u64;
        assert_eq!(head, 4, "the first chunk: 0, 1, 2, 3");
        assert_eq!(counts(), (41 + 41 - head, head));
        let third = chunks.read(b);
        let (two, three) = (pieces(&second), pieces(&third));
        let last = three.last().unwrap().len() as u64;
        assert_eq!(counts(), (82 - head + last, head + 41 - last));
        assert!(three.len() > 10 && last < 5, "{three:?}");
        assert_eq!(two.len(), three.len());
        let n = three.len() - 1;
        assert!(two[..n].iter().zip(&three).all(|(a, b)| Arc::ptr_eq(a, b)));
        assert_eq!(flat(third).unwrap().0, (0..41).collect::<Vec<_>>());
        let tiny = IdChunks::new(8);
        for _ in 0..3 {
            assert_eq!(flat(tiny.read(b)), int_array(b));
        }
        assert_eq!(tiny.cached.get(), 0);
    }
}
