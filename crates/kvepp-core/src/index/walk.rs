//! Lookups: how long a prefix of a request each rank holds. [`PrefixIndex::find_matches`] reads
//! every matched block (batched probes); [`PrefixIndex::find_matches_jumping`] searches for the
//! points where the holders change (exact for prefix-closed ranks). A walk leaves its runs in a
//! [`MatchScratch`], read per rank with [`PrefixIndex::walked`] or all at once.
//!
//! Invariants: per rank, device ≤ host ≤ any; only ranks holding the first block are reported; a
//! scratch's runs belong to the walk of its current epoch only.

use super::holders::{holder_ident, Holder, HolderList, Holders};
use super::scratch::Run;
use super::*;

impl PrefixIndex {
    /// The cached prefix of `hashes` on every rank that holds at least its first block, into `out`
    /// (cleared first). Costs one table lookup per matched block, plus one step per holder where
    /// the holders change: consecutive blocks held by the same ranks alike (a shared prefix) cost
    /// one comparison each, however many ranks hold them.
    pub fn find_matches(
        &self,
        hashes: &[SequenceHash],
        scratch: &mut MatchScratch,
        out: &mut Vec<RankOverlap>,
    ) {
        self.walk(hashes, scratch, false);
        self.walked_all(scratch, out);
    }

    /// Walks `hashes` into `scratch` ([`Self::find_matches_jumping`]'s search where `jump`, else
    /// [`Self::find_matches`]'s walk), for [`Self::walked`] and [`Self::walked_all`].
    pub fn walk(&self, hashes: &[SequenceHash], scratch: &mut MatchScratch, jump: bool) {
        scratch.begin(self.ranks.len());
        if jump && hashes.len() >= JUMP_MIN_BLOCKS {
            self.walk_jumping(hashes, scratch);
        } else {
            self.walk_exact(hashes, scratch);
        }
    }

    fn walk_exact(&self, hashes: &[SequenceHash], scratch: &mut MatchScratch) {
        // The holders of the block that last extended the runs, and how many blocks since held
        // alike (their extension is applied when the holders change or the walk ends).
        let mut streak: Option<(u64, HolderList<'_>, u32)> = None;
        let mut pending = 0u32;
        // The table word of the last block held alike: an equal word is the same holders (one
        // rank with the same counts, or the same spilled list), known without unpacking it.
        let mut alike = 0u64;
        self.probe_each(hashes, |i, word| {
            if word == alike {
                pending += 1;
                return true;
            }
            alike = word;
            let (ident, list) = self.holders_ident(word);
            if let Some((id, prev, _)) = &streak {
                if *id == ident && prev.as_slice().len() == list.as_slice().len() {
                    pending += 1;
                    return true;
                }
            }
            if let Some((_, prev, at)) = streak.take() {
                Self::extend_alike(scratch, prev.as_slice(), at, pending);
                pending = 0;
            }
            let i = i as u32;
            if !Self::extend_runs(scratch, list.as_slice(), i) {
                return false;
            }
            streak = Some((ident, list, i));
            true
        });
        if let Some((_, prev, at)) = streak {
            Self::extend_alike(scratch, prev.as_slice(), at, pending);
        }
    }

    /// Probes the blocks of `hashes` from the first, calling `f(i, word)` for each held one
    /// until one is not held or `f` answers false. Lookups go in batches of independent probes
    /// (4 first: most requests stop early; then 64), so the table's cache misses overlap instead
    /// of queueing one behind another.
    pub(super) fn probe_each(
        &self,
        hashes: &[SequenceHash],
        mut f: impl FnMut(usize, u64) -> bool,
    ) {
        let mut start = 0;
        let mut batch = 4;
        while start < hashes.len() {
            let end = (start + batch).min(hashes.len());
            let mut keys = [0u64; MAX_BATCH];
            for (k, seq) in keys.iter_mut().zip(&hashes[start..end]) {
                *k = seq.0;
            }
            let mut words = [0u64; MAX_BATCH];
            let n = end - start;
            self.blocks.get_batch(&keys[..n], &mut words);
            for (j, &word) in words[..n].iter().enumerate() {
                if word == 0 || !f(start + j, word) {
                    return;
                }
            }
            start = end;
            batch = MAX_BATCH;
        }
    }

    /// The holders of a non-empty table word, with the identity the walks compare
    /// ([`holder_ident`] or the spilled list's [`fingerprint`]).
    pub(super) fn holders_ident(&self, word: u64) -> (u64, HolderList<'_>) {
        match Holders::unpack(word) {
            Holders::One(h) => (holder_ident(&h), HolderList::One(h)),
            Holders::Spill(i) => (
                self.spill_fp[i as usize],
                HolderList::Many(&self.spill[i as usize]),
            ),
        }
    }

    /// [`Self::find_matches`] for an index whose ranks hold prefix-closed sets in each tier class
    /// (a rank holding a block on device holds every block before it on device, and likewise for
    /// device-or-host and for any tier): engines that evict leaves first (vLLM's LRU frees a
    /// request's blocks tail first; SGLang's radix tree evicts leaves), and every index fed only by
    /// their events. Then the holders' identities along the prompt change only where some rank's
    /// run ends, so the walk searches for those points (a `JUMP_FANOUT`-ary search, its probes
    /// issued together) instead of reading every block: a few dozen table lookups per distinct
    /// holder set, however long the matched prefix. Equal to [`Self::find_matches`] on such
    /// indexes (a differential test checks it); where a rank has a gap (lost removal events), a
    /// run may extend over it. Prompts shorter than [`JUMP_MIN_BLOCKS`] take the exact walk.
    pub fn find_matches_jumping(
        &self,
        hashes: &[SequenceHash],
        scratch: &mut MatchScratch,
        out: &mut Vec<RankOverlap>,
    ) {
        self.walk(hashes, scratch, true);
        self.walked_all(scratch, out);
    }

    fn walk_jumping(&self, hashes: &[SequenceHash], scratch: &mut MatchScratch) {
        let n = hashes.len();
        let Some(word) = self.blocks.get(hashes[0].0) else {
            return;
        };
        let (mut ident, mut list) = self.holders_ident(word);
        let mut at = 0usize;
        if Self::extend_runs(scratch, list.as_slice(), 0) {
            loop {
                let len = list.as_slice().len();
                let (end, word) = self.first_unlike(hashes, ident, len, at);
                Self::extend_alike(scratch, list.as_slice(), at as u32, (end - at - 1) as u32);
                if end == n || word == 0 {
                    break;
                }
                (ident, list) = self.holders_ident(word);
                if !Self::extend_runs(scratch, list.as_slice(), end as u32) {
                    break;
                }
                at = end;
            }
        }
    }

    /// The first block after `at` whose holders are not those of block `at` (identity `ident`,
    /// `len` holders), with its table word (0: nobody holds it); `hashes.len()` and 0 if every
    /// later block is held alike. Assumes "held alike" is true up to a point and false after it
    /// (see [`Self::find_matches_jumping`]).
    pub(super) fn first_unlike(
        &self,
        hashes: &[SequenceHash],
        ident: u64,
        len: usize,
        at: usize,
    ) -> (usize, u64) {
        // Invariant: block `lo` is held alike; block `hi` is not (or `hi` is the end).
        let (mut lo, mut hi, mut hi_word) = (at, hashes.len(), 0u64);
        let mut keys = [0u64; JUMP_FANOUT];
        let mut words = [0u64; JUMP_FANOUT];
        let mut at_pos = [0usize; JUMP_FANOUT];
        while hi - lo > 1 {
            let gap = hi - lo;
            let k = (gap - 1).min(JUMP_FANOUT);
            for t in 0..k {
                // k points spread over (lo, hi), strictly increasing because gap ≥ k + 1.
                at_pos[t] = lo + (t + 1) * gap / (k + 1);
                keys[t] = hashes[at_pos[t]].0;
            }
            self.blocks.get_batch(&keys[..k], &mut words[..k]);
            let first_unlike = (0..k).find(|&t| {
                let w = words[t];
                w == 0 || {
                    let (id, l) = self.holders_ident(w);
                    id != ident || l.as_slice().len() != len
                }
            });
            match first_unlike {
                Some(t) => {
                    hi = at_pos[t];
                    hi_word = words[t];
                    if t > 0 {
                        lo = at_pos[t - 1];
                    }
                }
                None => lo = at_pos[k - 1],
            }
        }
        (hi, hi_word)
    }

    /// After [`Self::walk`] with `scratch` (and no change to the index since): `rank`'s cached
    /// prefix (None: not even the first block). `hint` remembers the rank's slot: when it is
    /// right, no hashing; when wrong, the slot is looked up and the hint corrected.
    #[inline]
    pub fn walked(
        &self,
        scratch: &MatchScratch,
        rank: WorkerRank,
        hint: &AtomicU32,
    ) -> Option<Overlap> {
        let at = hint.load(Ordering::Relaxed) as usize;
        let s = match self.slot_ids.get(at) {
            Some(id) if *id == SlotId::live(rank) => at,
            _ => {
                let s = usize::from(self.slot_of(rank)?);
                hint.store(s as u32, Ordering::Relaxed);
                s
            }
        };
        if scratch.lazy {
            return self.level_run(scratch, s as u16);
        }
        scratch
            .runs
            .get(s)
            .filter(|r| r.epoch == scratch.epoch && r.any > 0)
            .map(Run::overlap)
    }

    /// Whether some rank here has a data-parallel rank other than 0.
    pub fn has_nonzero_dp_ranks(&self) -> bool {
        self.nonzero_dp_ranks > 0
    }

    /// The runs the last [`Self::walk`] with `scratch` found, one per rank it touched, into `out`
    /// (cleared first).
    pub fn walked_all(&self, scratch: &MatchScratch, out: &mut Vec<RankOverlap>) {
        out.clear();
        if scratch.lazy {
            return self.level_runs_all(scratch, out);
        }
        out.extend(scratch.touched.iter().map(|&s| RankOverlap {
            rank: self.slot(s).id,
            overlap: scratch.runs[usize::from(s)].overlap(),
        }));
    }

    /// The `k` blocks after block `at` had the same holders as block `at`: every run that block
    /// `at` extended grows by `k` (in each tier it was extended in).
    pub(super) fn extend_alike(scratch: &mut MatchScratch, holders: &[Holder], at: u32, k: u32) {
        if k == 0 {
            return;
        }
        let epoch = scratch.epoch;
        let next = at + 1;
        for h in holders {
            let run = &mut scratch.runs[usize::from(h.rank)];
            if run.epoch != epoch || run.any != next {
                continue;
            }
            run.any += k;
            if run.host == next {
                run.host += k;
            }
            if run.device == next {
                run.device += k;
            }
        }
    }

    /// Extends the runs of the ranks in `holders` that held every block before block `i`; false
    /// when none did (the walk is over).
    pub(super) fn extend_runs(scratch: &mut MatchScratch, holders: &[Holder], i: u32) -> bool {
        let epoch = scratch.epoch;
        let mut alive = false;
        for h in holders {
            let run = &mut scratch.runs[usize::from(h.rank)];
            if i == 0 {
                *run = Run {
                    epoch,
                    ..Run::default()
                };
                scratch.touched.push(h.rank);
            } else if run.epoch != epoch || run.any != i {
                continue;
            }
            alive = true;
            run.any = i + 1;
            if run.host == i && (h.refs[0] > 0 || h.refs[1] > 0) {
                run.host = i + 1;
            }
            if run.device == i && h.refs[0] > 0 {
                run.device = i + 1;
            }
        }
        alive
    }

    /// [`Self::find_matches`] with fresh scratch space (convenient, allocates).
    pub fn overlaps(&self, hashes: &[SequenceHash]) -> Vec<RankOverlap> {
        let mut out = Vec::new();
        self.find_matches(hashes, &mut MatchScratch::default(), &mut out);
        out
    }
}
