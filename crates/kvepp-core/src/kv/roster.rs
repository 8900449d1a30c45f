//! The roster of a candidate list for ordered picks: which candidate each worker, dense id and
//! KV-event index slot is, made once per list, and the counts of picks by path.
//!
//! A list the caller names ([`crate::PickRequest::list`], the pool snapshot's serial) is
//! recognised without reading it; an unnamed one is compared endpoint by endpoint, and mapped
//! only once it comes twice in a row. Making it registers, idle, any candidate the slot tracker
//! does not know yet (the scan counts such a candidate idle; its first booking would register
//! it).
//!
//! Invariants: a roster is rebuilt whenever the list or the tracker's registrations change, so
//! it never names a candidate for a rank that is not it; a candidate's slot hint is written
//! only with the dense id the tracker gave its rank. A roster is also made again when an index
//! gives or frees a slot (its slot epoch moves), and its slot map with it. The index a pick
//! reads may still have moved since its roster was checked, so each entry of the slot map names
//! the worker it was made for, and the map the slot epoch it was made at: at that epoch no slot
//! has changed and the entries are taken as they are; at another, a slot whose worker differs
//! now is looked up by worker.

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

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
    /// roster lives) and the tracker's registrations and the indexes' slots when it was made
    /// ([`KvState::roster_generation`]).
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
    /// Candidate index → dense id (the hint each candidate was given).
    dense_of: Vec<u32>,
    /// Index slot → its worker's candidate, per index (KV-event, approximate: each numbers its
    /// slots its own way), made at the first pick that reads a level's holders one by one (see
    /// [`Maps::slot_map`]).
    by_slot: [OnceLock<SlotTable>; 2],
}

/// The entries of a [`SlotMap`], and the index's slot epoch they were made at.
#[derive(Debug)]
struct SlotTable {
    epoch: u64,
    entries: Box<[SlotEntry]>,
}

/// What [`Maps::by_slot`] knows of an index slot: the worker it had when the map was made, and
/// that worker's candidate index and dense id. `i == u32::MAX`: not a candidate (`dense` 0) or
/// a slot that was not live (`dense` `u32::MAX`, which no lookup trusts).
#[derive(Debug, Clone, Copy)]
struct SlotEntry {
    worker: u64,
    i: u32,
    dense: u32,
}

impl SlotEntry {
    const UNKNOWN: SlotEntry = SlotEntry {
        worker: 0,
        i: u32::MAX,
        dense: u32::MAX,
    };

    fn not_a_candidate(worker: u64) -> SlotEntry {
        SlotEntry {
            worker,
            i: u32::MAX,
            dense: 0,
        }
    }
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

    /// The index slots' candidates ([`SlotMap`]), the map made on first use from `slots` (the
    /// index's live slots and their workers). `index` names the index (which of an endpoint's
    /// index hints it uses) and its slot epoch ([`crate::index::PrefixIndex::slot_epoch`]) now:
    /// while the epoch is the one the map was made at, its entries are taken without checking
    /// their workers.
    pub(super) fn slot_map<I>(&self, index: (usize, u64), slots: impl FnOnce() -> I) -> SlotMap<'_>
    where
        I: Iterator<Item = (u16, u64)>,
    {
        let Some(cell) = self.by_slot.get(index.0) else {
            return SlotMap {
                maps: self,
                entries: &[],
                current: false,
            };
        };
        let table = cell.get_or_init(|| SlotTable {
            epoch: index.1,
            entries: self.make_slot_map(slots()),
        });
        SlotMap {
            maps: self,
            entries: &table.entries,
            current: table.epoch == index.1,
        }
    }

    fn make_slot_map(&self, slots: impl Iterator<Item = (u16, u64)>) -> Box<[SlotEntry]> {
        let mut map = Vec::new();
        for (s, worker) in slots {
            let s = usize::from(s);
            if map.len() <= s {
                map.resize(s + 1, SlotEntry::UNKNOWN);
            }
            map[s] = self.of_worker_dense(worker).map_or(
                SlotEntry::not_a_candidate(worker),
                |(i, dense)| SlotEntry {
                    worker,
                    i: i as u32,
                    dense,
                },
            );
        }
        map.into_boxed_slice()
    }

    /// The candidate of `worker` and its dense id, from the roster alone (no read of the
    /// endpoint: the roster is of this very list, so its map names the candidate's worker).
    #[inline]
    pub(super) fn of_worker_dense(&self, worker: u64) -> Option<(usize, u32)> {
        let i = self.by_worker.get(worker)?;
        Some((i, *self.dense_of.get(i)?))
    }
}

/// Index slot → candidate, read without hashing: one entry per slot. Each entry says which
/// worker it is for, so a slot the index has given another worker since the map was made is
/// looked up by worker instead: never a wrong candidate, at worst the slower way. While the
/// index's slots are as they were when the map was made (`current`), the worker is not read.
pub(super) struct SlotMap<'a> {
    maps: &'a Maps,
    entries: &'a [SlotEntry],
    current: bool,
}

impl SlotMap<'_> {
    /// The candidate of index slot `slot`, whose worker `worker` reads (None: the slot has
    /// none), and its dense id.
    #[inline]
    pub(super) fn get(
        &self,
        slot: u16,
        worker: impl FnOnce() -> Option<u64>,
    ) -> Option<(usize, u32)> {
        let entry = self.entries.get(usize::from(slot));
        if self.current {
            match entry {
                Some(e) if e.i != u32::MAX => return Some((e.i as usize, e.dense)),
                Some(e) if e.dense == 0 => return None,
                // A slot that was not live: read as a changed one.
                _ => {}
            }
        }
        let worker = worker()?;
        match entry {
            Some(e) if e.worker == worker && e.i != u32::MAX => Some((e.i as usize, e.dense)),
            Some(e) if e.worker == worker && e.dense == 0 => None,
            _ => self.maps.of_worker_dense(worker),
        }
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

    /// What a roster is made for besides its list: the tracker's registrations and both
    /// indexes' slot epochs, summed (each only grows, so the sum moves whenever one does). A
    /// roster made before an index gave or freed a slot is made again, and with it the slot
    /// maps, which then hold for the new slots.
    fn roster_generation(&self) -> u64 {
        self.slots
            .generation()
            .wrapping_add(self.index.slot_epoch())
            .wrapping_add(self.approx.index.slot_epoch())
    }

    /// The generation the current roster was made at (tests).
    #[cfg(test)]
    pub(super) fn roster_made_at(&self) -> Option<u64> {
        self.ordered.roster.load().as_ref().map(|r| r.generation)
    }

    /// The roster of `candidates`, made anew if the list, the registrations or the indexes'
    /// slots changed. A candidate the slot tracker does not know yet is registered first (idle,
    /// as the scan counts it, and as its first booking would register it).
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
        let generation = self.roster_generation();
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
        let generation = self.roster_generation();
        let mut by_worker = CandidateMap::default();
        by_worker.build(candidates.iter().map(|e| e.worker));
        let mut by_dense = Vec::new();
        let mut dense_of = Vec::with_capacity(candidates.len());
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
            dense_of.push(id);
        }
        let roster = Arc::new(Roster {
            eps: candidates.into(),
            generation,
            list,
            maps: usable.then_some(Maps {
                by_worker,
                by_dense,
                dense_of,
                by_slot: Default::default(),
            }),
        });
        self.ordered.roster.store(Some(roster.clone()));
        Some(RosterRef::Made(roster))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Workers 10, 20 and 30 are candidates 0, 1, 2 with dense ids 7, 8, 9; 40 is no candidate.
    fn maps() -> Maps {
        let mut by_worker = CandidateMap::default();
        by_worker.build([10u64, 20, 30].into_iter());
        Maps {
            by_worker,
            by_dense: Vec::new(),
            dense_of: vec![7, 8, 9],
            by_slot: Default::default(),
        }
    }

    #[test]
    fn a_slot_given_another_worker_since_the_map_was_made_is_looked_up_by_worker() {
        let maps = maps();
        let w = |worker: u64| move || Some(worker);
        // The index when the map is made (index 0 at slot epoch 5): slot 0 is worker 10's, 1
        // is 20's, 3 is 40's (no candidate), 2 is free.
        let map = maps.slot_map((0, 5), || [(0u16, 10u64), (1, 20), (3, 40)].into_iter());
        assert_eq!(map.get(0, w(10)), Some((0, 7)));
        assert_eq!(map.get(1, w(20)), Some((1, 8)));
        assert_eq!(map.get(3, w(40)), None);
        // While the slots are as they were, a holder's worker is not read...
        let unread = || -> Option<u64> { panic!("the worker was read") };
        assert_eq!(map.get(1, unread), Some((1, 8)));
        assert_eq!(map.get(3, unread), None);
        // ...but for a slot that was free (or past the map's end), which it reads as changed.
        assert_eq!(map.get(2, w(30)), Some((2, 9)));
        assert_eq!(map.get(9, || None), None);
        // Since then the index freed slot 1 and gave it to worker 30, gave the free slot 2 to
        // worker 20, slot 3 to worker 10, and made slot 9, past the map's end, worker 30's. The
        // map is not made again, but at the later epoch its entries are checked.
        let map = maps.slot_map((0, 6), || -> std::vec::IntoIter<(u16, u64)> {
            panic!("the slot map was made again")
        });
        assert_eq!(map.get(1, w(30)), Some((2, 9)));
        assert_eq!(map.get(2, w(20)), Some((1, 8)));
        assert_eq!(map.get(3, w(10)), Some((0, 7)));
        assert_eq!(map.get(9, w(30)), Some((2, 9)));
        // A worker that is no candidate, in a slot the map gave a candidate.
        assert_eq!(map.get(0, w(40)), None);
        assert_eq!(map.get(0, w(10)), Some((0, 7)));
        // The other index numbers its slots its own way (its epoch may be the same number): its
        // own map, made from its own slots.
        let other = maps.slot_map((1, 5), || [(0u16, 30u64), (1, 10)].into_iter());
        assert_eq!(other.get(0, unread), Some((2, 9)));
        assert_eq!(other.get(1, unread), Some((0, 7)));
        assert_eq!(
            maps.slot_map((0, 5), || None.into_iter()).get(0, unread),
            Some((0, 7))
        );
        // An index the roster has no map for is read by worker.
        assert_eq!(
            maps.slot_map((2, 5), || None.into_iter()).get(0, w(20)),
            Some((1, 8))
        );
    }
}
