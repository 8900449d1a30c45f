//! The roster of a candidate list for ordered picks: which candidate each worker and dense id
//! is, made once per list, and the counts of picks by path.
//!
//! A list the caller names ([`crate::PickRequest::list`], the pool snapshot's serial) is
//! recognised without reading it; an unnamed one is compared endpoint by endpoint, and mapped
//! only once it comes twice in a row. Making it registers, idle, any candidate the slot tracker
//! does not know yet (the scan counts such a candidate idle; its first booking would register
//! it).
//!
//! Invariants: a roster is rebuilt whenever the list or the tracker's registrations change, so
//! it never names a candidate for a rank that is not it; a candidate's slot hint is written
//! only with the dense id the tracker gave its rank.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::scratch::CandidateMap;
use super::KvState;
use crate::Endpoint;

/// What ordered picks keep in a [`KvState`]: the last candidate list's roster, whether they
/// are on, how many picks took each path, and the fingerprint of the last unnamed list left
/// unmapped.
#[derive(Debug)]
pub(super) struct OrderedPicks {
    roster: arc_swap::ArcSwapOption<Roster>,
    pub(super) on: std::sync::atomic::AtomicBool,
    pub(super) paths: PickPaths,
    unnamed: std::sync::atomic::AtomicU64,
}

impl Default for OrderedPicks {
    fn default() -> Self {
        OrderedPicks {
            roster: arc_swap::ArcSwapOption::empty(),
            on: std::sync::atomic::AtomicBool::new(true),
            paths: PickPaths::default(),
            unnamed: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

/// How many picks were ordered and how many scanned, counted per scratch pool (so concurrent
/// picks rarely write one line).
#[derive(Debug, Default)]
pub(super) struct PickPaths([PathCounts; super::SCRATCH_POOLS]);

#[derive(Debug, Default)]
#[repr(align(128))]
struct PathCounts {
    ordered: std::sync::atomic::AtomicU64,
    scanned: std::sync::atomic::AtomicU64,
}

impl PickPaths {
    pub(super) fn count(&self, pool: usize, ordered: bool) {
        if let Some(c) = self.0.get(pool) {
            let n = if ordered { &c.ordered } else { &c.scanned };
            n.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A candidate list as the slot tracker numbers it.
#[derive(Debug)]
pub(super) struct Roster {
    /// The list it maps (held, so no other endpoint can take an address of it while the
    /// roster lives) and the tracker's registrations when it was made.
    eps: Box<[Arc<Endpoint>]>,
    generation: u64,
    /// The list's identity as its caller named it ([`crate::PickRequest::list`]).
    list: Option<u64>,
    /// None: some candidate cannot be picked this way.
    pub(super) maps: Option<Maps>,
}

#[derive(Debug)]
pub(super) struct Maps {
    by_worker: CandidateMap,
    /// Dense id → candidate index (`u32::MAX`: not a candidate).
    by_dense: Vec<u32>,
}

impl Maps {
    /// The candidate with dense id `id`, if it is one (and its endpoint agrees).
    pub(super) fn of_dense(&self, id: u32, candidates: &[Arc<Endpoint>]) -> Option<usize> {
        let i = *self.by_dense.get(id as usize)? as usize;
        let e = candidates.get(i)?;
        (e.hints.slot.load(Ordering::Relaxed) == id).then_some(i)
    }

    /// The candidate of `worker`, if it is one.
    pub(super) fn of_worker(&self, worker: u64, candidates: &[Arc<Endpoint>]) -> Option<usize> {
        let i = self.by_worker.get(worker)?;
        (candidates.get(i)?.worker == worker).then_some(i)
    }
}

impl Roster {
    fn is_of(&self, candidates: &[Arc<Endpoint>], generation: u64, list: Option<u64>) -> bool {
        if self.generation != generation || self.eps.len() != candidates.len() {
            return false;
        }
        // A list the caller named is the one its name was first seen with: nothing to read.
        if list.is_some() && list == self.list {
            return true;
        }
        // Blocks of differences or-ed together without a branch per candidate.
        self.eps
            .chunks(64)
            .zip(candidates.chunks(64))
            .all(|(a, b)| {
                a.iter().zip(b).fold(0, |acc, (p, e)| {
                    acc | (Arc::as_ptr(p) as usize ^ Arc::as_ptr(e) as usize)
                }) == 0
            })
    }
}

/// A roster as a pick holds it: the shared one, borrowed without a write to its reference
/// count (which every picking thread would otherwise share), or one just made.
pub(super) enum RosterRef {
    Shared(arc_swap::Guard<Option<Arc<Roster>>>),
    Made(Arc<Roster>),
}

impl RosterRef {
    pub(super) fn get(&self) -> Option<&Roster> {
        match self {
            RosterRef::Shared(g) => g.as_deref(),
            RosterRef::Made(r) => Some(r),
        }
    }
}

/// A fingerprint of an unnamed candidate list: its endpoints in order (equal prints only make a
/// roster worth building; [`Roster::is_of`] is what decides a match).
fn fingerprint(candidates: &[Arc<Endpoint>]) -> u64 {
    candidates.iter().fold(candidates.len() as u64, |h, e| {
        (h ^ Arc::as_ptr(e) as u64)
            .wrapping_mul(0xBF58_476D_1CE4_E5B9)
            .rotate_left(29)
    }) | 1
}

impl KvState {
    /// Turns ordered picks on (the default) or off (every pick reads every candidate: the
    /// reference the ordered pick is tested and measured against).
    pub fn set_ordered_picks(&self, on: bool) {
        self.ordered.on.store(on, Ordering::Relaxed);
    }

    /// Picks made so far by the ordered shortcut, and by reading every candidate.
    pub fn pick_paths(&self) -> (u64, u64) {
        self.ordered.paths.0.iter().fold((0, 0), |(o, s), c| {
            (
                o + c.ordered.load(Ordering::Relaxed),
                s + c.scanned.load(Ordering::Relaxed),
            )
        })
    }

    /// The roster of `candidates`, made anew if the list or the registrations changed. A
    /// candidate the slot tracker does not know yet is registered first (idle, as the scan
    /// counts it, and as its first booking would register it).
    ///
    /// An unnamed list is mapped only once it comes twice in a row (by a fingerprint of its
    /// endpoints): a list that changes from pick to pick (the selector leaving out whichever
    /// endpoints are saturated) would cost more to map each time than to scan. None: not
    /// mapped this time.
    pub(super) fn roster(
        &self,
        candidates: &[Arc<Endpoint>],
        list: Option<u64>,
    ) -> Option<RosterRef> {
        let cached = self.ordered.roster.load();
        let generation = self.slots.generation();
        if cached
            .as_ref()
            .is_some_and(|r| r.is_of(candidates, generation, list))
        {
            return Some(RosterRef::Shared(cached));
        }
        if list.is_none() {
            let print = fingerprint(candidates);
            if self.ordered.unnamed.swap(print, Ordering::Relaxed) != print {
                return None;
            }
        }
        for e in candidates.iter().filter(|e| e.rank().dp_rank == 0) {
            if self.slots.dense_id(e.rank()).is_none() {
                self.slots.register(e.rank());
            }
        }
        let generation = self.slots.generation();
        let mut by_worker = CandidateMap::default();
        by_worker.build(candidates.iter().map(|e| e.worker));
        let mut by_dense = Vec::new();
        let mut usable = true;
        for (i, e) in candidates.iter().enumerate() {
            let rank = e.rank();
            let id = self
                .slots
                .dense_id(rank)
                .filter(|_| rank.dp_rank == 0 && by_worker.get(e.worker) == Some(i));
            let Some(id) = id else {
                usable = false;
                break;
            };
            // Picks read a candidate's load through this hint.
            e.hints.slot.store(id, Ordering::Relaxed);
            if by_dense.len() <= id as usize {
                by_dense.resize(id as usize + 1, u32::MAX);
            }
            by_dense[id as usize] = i as u32;
        }
        let roster = Arc::new(Roster {
            eps: candidates.into(),
            generation,
            list,
            maps: usable.then_some(Maps {
                by_worker,
                by_dense,
            }),
        });
        self.ordered.roster.store(Some(roster.clone()));
        Some(RosterRef::Made(roster))
    }
}
