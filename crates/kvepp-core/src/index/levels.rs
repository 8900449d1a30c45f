//! Walks that leave the holders where they are: [`PrefixIndex::walk_levels`] records the
//! prompt's *levels* (each stretch of blocks held alike, with the table word of its holders)
//! instead of writing a run for every holder, so a walk over blocks that half the fleet holds
//! costs its table probes, not a write per holder. One rank's run is then worked out when it is
//! asked for ([`PrefixIndex::walked`] on such a scratch): the levels replayed for that rank
//! alone, one binary search in each spilled list (they are kept in slot order).
//!
//! What it owns: the levels of the last lazy walk in a [`MatchScratch`].
//!
//! Invariants: a rank's run read from levels equals the run [`PrefixIndex::walk`] would have
//! written for it (`tests::level_runs_equal_the_walks_runs`); every rank that holds any of the
//! prompt is a holder of the first level, and of a level whose end is at least its run.

use super::holders::{find, Holder, HolderList};
use super::scratch::{Level, Run};
use super::*;

/// One level as a pick reads it: where it ends and who holds it.
#[derive(Clone, Copy)]
pub struct LevelView<'a> {
    ix: &'a PrefixIndex,
    end: u32,
    list: HolderList<'a>,
}

impl LevelView<'_> {
    /// Blocks from the prompt's start to the level's end: no holder of it has a longer run
    /// through it (a holder that missed an earlier block has a shorter one).
    pub fn end(&self) -> u64 {
        u64::from(self.end)
    }

    /// How many ranks hold the level's blocks.
    pub fn len(&self) -> usize {
        self.list.as_slice().len()
    }

    /// Whether no rank holds it (never, for a level a walk recorded).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `j`-th holder (in slot order).
    pub fn rank(&self, j: usize) -> Option<WorkerRank> {
        let h = self.list.as_slice().get(j)?;
        Some(self.ix.slot(h.rank).id)
    }

    /// The holders' slots, in slot order (what a pick that visits every holder of a level
    /// reads of each; [`PrefixIndex::slot_worker`] names a slot's worker).
    pub fn slots(&self) -> impl Iterator<Item = u16> + '_ {
        self.list.as_slice().iter().map(|h| h.rank)
    }
}

impl PrefixIndex {
    /// Walks `hashes` into `scratch` as levels (see the module documentation): the search of
    /// [`Self::find_matches_jumping`] where `jump`, else every block; [`Self::walked`] and
    /// [`Self::walked_all`] then read runs from the levels. Like [`Self::walk`], it stops where
    /// nobody holds a block or no rank's run is still alive (a rank that lost a prompt's first
    /// blocks but kept later ones is not followed through them).
    pub fn walk_levels(&self, hashes: &[SequenceHash], scratch: &mut MatchScratch, jump: bool) {
        scratch.begin_levels();
        if jump && hashes.len() >= JUMP_MIN_BLOCKS {
            self.levels_jumping(hashes, scratch);
        } else {
            self.levels_exact(hashes, scratch);
        }
    }

    fn levels_exact(&self, hashes: &[SequenceHash], scratch: &mut MatchScratch) {
        // The identity of the current level's holders; a block held alike extends it.
        let mut cur: Option<(u64, usize)> = None;
        self.probe_each(hashes, |i, word| {
            let (ident, list) = self.holders_ident(word);
            let len = list.as_slice().len();
            if cur == Some((ident, len)) {
                if let Some(l) = scratch.levels.last_mut() {
                    l.alike += 1;
                }
                return true;
            }
            cur = Some((ident, len));
            self.open_level(scratch, i, word)
        });
    }

    fn levels_jumping(&self, hashes: &[SequenceHash], scratch: &mut MatchScratch) {
        let n = hashes.len();
        let Some(mut word) = self.blocks.get(hashes[0].0) else {
            return;
        };
        let mut at = 0usize;
        while self.open_level(scratch, at, word) {
            let (ident, list) = self.holders_ident(word);
            let (end, next) = self.first_unlike(hashes, ident, list.as_slice().len(), at);
            if let Some(l) = scratch.levels.last_mut() {
                l.alike = (end - at - 1) as u32;
            }
            if end == n || next == 0 {
                break;
            }
            (word, at) = (next, end);
        }
    }

    /// Starts a level at block `start` held by `word`'s holders, if some rank's run is still
    /// alive there (it held every block before): false, and no level, where none is, and the
    /// walk stops, as [`Self::walk`] does. One rank known alive (`scratch.witness`) is checked
    /// first; only when its run has ended are the level's holders searched for another.
    fn open_level(&self, scratch: &mut MatchScratch, start: usize, word: u64) -> bool {
        scratch.levels.push(Level {
            start: start as u32,
            alike: 0,
            word,
        });
        let list = self.holders_ident(word).1;
        if start == 0 {
            scratch.witness = list.as_slice().first().map_or(0, |h| h.rank);
            return true;
        }
        let alive = |s: u16| {
            self.level_run(scratch, s)
                .is_some_and(|o| o.disk > start as u64)
        };
        if alive(scratch.witness) {
            return true;
        }
        let found = list.as_slice().iter().map(|h| h.rank).find(|&s| alive(s));
        match found {
            Some(s) => {
                scratch.witness = s;
                true
            }
            None => {
                scratch.levels.pop();
                false
            }
        }
    }

    /// The worker of slot `s` (read from the flat slot table); None past the table's end.
    #[inline]
    pub fn slot_worker(&self, s: u16) -> Option<u64> {
        self.slot_ids.get(usize::from(s)).map(|id| id.worker)
    }

    /// Changes the slots have seen (each given to a rank, or freed): while the count stays,
    /// [`Self::slot_workers`] stays as it was.
    pub fn slot_epoch(&self) -> u64 {
        self.slot_changes
    }

    /// Every live slot and its worker (the numbering [`LevelView::slots`] uses).
    pub fn slot_workers(&self) -> impl Iterator<Item = (u16, u64)> + '_ {
        self.slot_ids
            .iter()
            .zip(0..=u16::MAX)
            .filter(|(id, _)| id.live)
            .map(|(id, s)| (s, id.worker))
    }

    /// How many levels the last [`Self::walk_levels`] with `scratch` recorded (0 after a
    /// [`Self::walk`]; [`Self::materialize`] keeps them).
    pub fn level_count(&self, scratch: &MatchScratch) -> usize {
        if scratch.has_levels {
            scratch.levels.len()
        } else {
            0
        }
    }

    /// Level `k` of the last [`Self::walk_levels`] with `scratch`.
    pub fn level<'a>(&'a self, scratch: &MatchScratch, k: usize) -> Option<LevelView<'a>> {
        let l = scratch.levels.get(k).filter(|_| scratch.has_levels)?;
        Some(LevelView {
            ix: self,
            end: l.start + l.alike + 1,
            list: self.holders_ident(l.word).1,
        })
    }

    /// Slot `s`'s run over the levels in `scratch`: what [`Self::walk`] would have written.
    pub(super) fn level_run(&self, scratch: &MatchScratch, s: u16) -> Option<Overlap> {
        let mut run = Run::default();
        for (k, l) in scratch.levels.iter().enumerate() {
            let held: Option<Holder> = match self.holders_ident(l.word).1 {
                HolderList::One(h) => (h.rank == s).then_some(h),
                HolderList::Many(list) => find(list, s).ok().map(|p| list[p]),
            };
            let Some(h) = held else {
                break;
            };
            let i = l.start;
            if k > 0 && run.any != i {
                break;
            }
            run.any = i + 1;
            if run.host == i && (h.refs[0] > 0 || h.refs[1] > 0) {
                run.host = i + 1;
            }
            if run.device == i && h.refs[0] > 0 {
                run.device = i + 1;
            }
            // The level's other blocks are held alike: every run it extended grows with them.
            let next = i + 1;
            run.any += l.alike;
            if run.host == next {
                run.host += l.alike;
            }
            if run.device == next {
                run.device += l.alike;
            }
        }
        (run.any > 0).then(|| run.overlap())
    }

    /// Writes every holder's run from the levels in `scratch`, as [`Self::walk`] would have
    /// (a write per holder per level), so that [`Self::walked`] reads each in one step after:
    /// for a caller about to ask for many ranks' runs. No-op after a [`Self::walk`].
    pub fn materialize(&self, scratch: &mut MatchScratch) {
        if !scratch.lazy {
            return;
        }
        let levels = std::mem::take(&mut scratch.levels);
        scratch.begin(self.ranks.len());
        for l in &levels {
            let list = self.holders_ident(l.word).1;
            if !Self::extend_runs(scratch, list.as_slice(), l.start) {
                break;
            }
            Self::extend_alike(scratch, list.as_slice(), l.start, l.alike);
        }
        scratch.levels = levels;
        scratch.has_levels = true;
    }

    /// [`Self::walked_all`] over levels: every holder of the first level, with its run.
    pub(super) fn level_runs_all(&self, scratch: &MatchScratch, out: &mut Vec<RankOverlap>) {
        let Some(first) = scratch.levels.first() else {
            return;
        };
        for h in self.holders_ident(first.word).1.as_slice() {
            if let Some(overlap) = self.level_run(scratch, h.rank) {
                out.push(RankOverlap {
                    rank: self.slot(h.rank).id,
                    overlap,
                });
            }
        }
    }
}
