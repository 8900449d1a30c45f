//! What a walk of the index leaves behind, for the lookups ([`super::walk`]) and the lazy walks
//! ([`super::levels`]) alike: a [`MatchScratch`] holds one [`Run`] per rank after an eager walk,
//! or the [`Level`]s of a lazy one.
//!
//! Invariants: a scratch's runs belong to the walk of its current epoch only; `levels` are those
//! of the last lazy walk while `has_levels` is set.

use super::Overlap;

/// Reusable scratch space of [`super::PrefixIndex::find_matches`] (one per thread).
#[derive(Debug, Default)]
pub struct MatchScratch {
    pub(super) runs: Vec<Run>,
    pub(super) touched: Vec<u16>,
    pub(super) epoch: u32,
    /// The last walk was [`super::PrefixIndex::walk_levels`], not materialized since: runs are read
    /// from `levels`.
    pub(super) lazy: bool,
    /// The last walk was [`super::PrefixIndex::walk_levels`]: `levels` are its.
    pub(super) has_levels: bool,
    pub(super) levels: Vec<Level>,
    /// A rank whose run was alive at the last level a walk into levels opened.
    pub(super) witness: u16,
}

impl MatchScratch {
    /// Starts a walk over an index of `ranks` rank slots: no run is current.
    pub(super) fn begin(&mut self, ranks: usize) {
        self.lazy = false;
        self.has_levels = false;
        self.touched.clear();
        if self.runs.len() < ranks {
            self.runs.resize(ranks, Run::default());
        }
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.runs.fill(Run::default());
            self.epoch = 1;
        }
    }

    /// Starts a walk into levels ([`super::PrefixIndex::walk_levels`]).
    pub(super) fn begin_levels(&mut self) {
        self.lazy = true;
        self.has_levels = true;
        self.levels.clear();
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Run {
    pub(super) epoch: u32,
    pub(super) device: u32,
    pub(super) host: u32,
    pub(super) any: u32,
}

impl Run {
    pub(super) fn overlap(&self) -> Overlap {
        Overlap {
            device: u64::from(self.device),
            host: u64::from(self.host),
            disk: u64::from(self.any),
        }
    }
}

/// Blocks `start ..= start + alike` of a walked prompt, held alike by the holders in `word`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Level {
    pub(super) start: u32,
    pub(super) alike: u32,
    pub(super) word: u64,
}
