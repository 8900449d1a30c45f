//! The block table: an open-addressing hash table (linear probing, backward-shift deletion) from a
//! sequence hash to a packed 8-byte holder word. A slot is 16 bytes, key and value in one cache
//! line, so a probe costs one memory access and the probes of a batch can be issued together
//! ([`BlockTable::get_batch`]) to overlap their cache misses.
//!
//! Invariants: the capacity is a power of two; at most 3/4 of the slots are used; a value word of 0
//! marks an empty slot (callers never store 0); every key sits in the probe run that starts at its
//! home slot with no empty slot in between.

use super::KeyedBuild;
use std::hash::BuildHasher;

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    key: u64,
    val: u64,
}

/// A zeroed slot array (all empty), backed by huge pages where the kernel allows it: probes land
/// anywhere in a table of tens of megabytes, and with 4 KiB pages nearly every probe would also
/// miss the TLB and wait for a page walk.
fn empty_slots(cap: usize) -> Vec<Slot> {
    let mut v = Vec::with_capacity(cap);
    advise_huge_pages(v.as_ptr() as usize, cap * std::mem::size_of::<Slot>());
    v.resize(cap, Slot::default());
    v
}

// The index's one system call: madvise on its own allocation (see SAFETY below).
#[allow(unsafe_code)]
#[cfg(target_os = "linux")]
fn advise_huge_pages(start: usize, bytes: usize) {
    const HUGE: usize = 2 << 20;
    if bytes < 2 * HUGE {
        return;
    }
    let aligned = (start + HUGE - 1) & !(HUGE - 1);
    let len = (start + bytes - aligned) & !(HUGE - 1);
    // SAFETY: madvise only advises the kernel about a range inside a live allocation (not yet
    // touched, so its pages can be huge from the first fault); it
    // changes neither its contents nor its validity. A failure (e.g. THP disabled) is harmless.
    unsafe {
        libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_: usize, _: usize) {}

#[derive(Debug, Clone)]
pub(super) struct BlockTable {
    slots: Vec<Slot>,
    mask: usize,
    len: usize,
    build: KeyedBuild,
}

const MIN_CAPACITY: usize = 16;

#[cfg(test)]
thread_local! {
    /// Keys looked up by `get` and `get_batch` on this thread (tests count a walk's probes).
    static PROBES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Keys looked up on this thread so far (tests only).
#[cfg(test)]
pub(super) fn probes() -> u64 {
    PROBES.with(std::cell::Cell::get)
}

#[inline(always)]
fn count_probes(_n: usize) {
    #[cfg(test)]
    PROBES.with(|p| p.set(p.get() + _n as u64));
}

impl BlockTable {
    pub(super) fn new(build: KeyedBuild) -> Self {
        BlockTable {
            slots: empty_slots(MIN_CAPACITY),
            mask: MIN_CAPACITY - 1,
            len: 0,
            build,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot>()
    }

    fn home(&self, key: u64) -> usize {
        (self.build.hash_one(key) as usize) & self.mask
    }

    /// `Ok(slot)` holding `key`, or `Err(slot)`: the empty slot where it would go.
    fn find(&self, key: u64) -> Result<usize, usize> {
        let mut i = self.home(key);
        loop {
            let s = self.slots[i];
            if s.val == 0 {
                return Err(i);
            }
            if s.key == key {
                return Ok(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    pub(super) fn get(&self, key: u64) -> Option<u64> {
        count_probes(1);
        self.find(key).ok().map(|i| self.slots[i].val)
    }

    /// Looks up `keys` with their first probes issued back to back (no dependency between them),
    /// then finishes any longer probe runs. `out[j]` is the value of `keys[j]` (0: absent).
    pub(super) fn get_batch(&self, keys: &[u64], out: &mut [u64]) {
        let mut homes = [0usize; 64];
        let n = keys.len().min(out.len()).min(homes.len());
        count_probes(n);
        for j in 0..n {
            homes[j] = self.home(keys[j]);
        }
        for j in 0..n {
            let s = self.slots[homes[j]];
            out[j] = if s.val == 0 {
                0
            } else if s.key == keys[j] {
                s.val
            } else {
                self.find(keys[j]).map_or(0, |i| self.slots[i].val)
            };
        }
    }

    /// The value word of `key`, inserting `init` first when absent (`init` ≠ 0).
    pub(super) fn get_or_insert(&mut self, key: u64, init: u64) -> (&mut u64, bool) {
        debug_assert_ne!(init, 0);
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        match self.find(key) {
            Ok(i) => (&mut self.slots[i].val, false),
            Err(i) => {
                self.slots[i] = Slot { key, val: init };
                self.len += 1;
                (&mut self.slots[i].val, true)
            }
        }
    }

    pub(super) fn get_mut(&mut self, key: u64) -> Option<&mut u64> {
        match self.find(key) {
            Ok(i) => Some(&mut self.slots[i].val),
            Err(_) => None,
        }
    }

    pub(super) fn remove(&mut self, key: u64) -> Option<u64> {
        let mut hole = self.find(key).ok()?;
        let val = self.slots[hole].val;
        self.len -= 1;
        // Backward shift: pull later members of the run into the hole when their home allows.
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask;
            let s = self.slots[j];
            if s.val == 0 {
                break;
            }
            let home = self.home(s.key);
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = Slot::default();
        Some(val)
    }

    fn grow(&mut self) {
        let cap = self.slots.len() * 2;
        self.rebuild(cap, |_, _| true);
    }

    /// Every (key, value) pair, in table order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.slots
            .iter()
            .filter(|s| s.val != 0)
            .map(|s| (s.key, s.val))
    }

    /// Keeps the entries for which `keep` returns true (it may rewrite the value; 0 drops it).
    pub(super) fn retain(&mut self, mut keep: impl FnMut(u64, &mut u64) -> bool) {
        let cap = self.slots.len();
        self.rebuild(cap, |k, v| keep(k, v) && *v != 0);
    }

    fn rebuild(&mut self, cap: usize, mut keep: impl FnMut(u64, &mut u64) -> bool) {
        let old = std::mem::replace(&mut self.slots, empty_slots(cap));
        self.mask = cap - 1;
        self.len = 0;
        for mut s in old {
            if s.val != 0 && keep(s.key, &mut s.val) {
                let Err(i) = self.find(s.key) else {
                    unreachable!("keys are unique")
                };
                self.slots[i] = s;
                self.len += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn agrees_with_a_hash_map_under_churn() {
        // A tiny key space on a small table forces long runs, wrap-around and many shifts.
        for seed in 0..20 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let mut t = BlockTable::new(KeyedBuild::with_key(rng.u64(..)));
            let mut m: HashMap<u64, u64> = HashMap::new();
            for _ in 0..5000 {
                let key = rng.u64(0..200);
                match rng.u8(0..4) {
                    0 | 1 => {
                        let v = rng.u64(1..1 << 60);
                        let (slot, new) = t.get_or_insert(key, v);
                        assert_eq!(new, !m.contains_key(&key));
                        if !new {
                            *slot = v;
                        }
                        m.insert(key, v);
                    }
                    2 => assert_eq!(t.remove(key), m.remove(&key)),
                    _ => {
                        let keys: Vec<u64> = (0..16).map(|_| rng.u64(0..200)).collect();
                        let mut out = [0u64; 16];
                        t.get_batch(&keys, &mut out);
                        for (k, v) in keys.iter().zip(out) {
                            assert_eq!(v, m.get(k).copied().unwrap_or(0));
                        }
                    }
                }
                assert_eq!(t.len(), m.len());
            }
            t.retain(|k, v| {
                *v += 1;
                k % 2 == 0
            });
            m.retain(|k, _| k % 2 == 0);
            assert_eq!(t.len(), m.len());
            for (k, v) in &m {
                assert_eq!(t.get(*k), Some(v + 1));
            }
        }
    }
}
