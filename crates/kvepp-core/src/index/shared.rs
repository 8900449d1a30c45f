//! A [`PrefixIndex`] that readers never wait for: two copies, left-right style.
//!
//! Readers load the published copy ([`SharedIndex::read`], an `arc-swap` load: no lock, no
//! waiting on writers). A writer applies its change to the unpublished copy and publishes it; the
//! copy readers just left becomes the unpublished one and must get the same change before it is
//! written again. Writers serialize among themselves on one mutex and pay every change twice;
//! readers pay one atomic load.
//!
//! Two ways to write:
//! - [`SharedIndex::write`] applies the change to the old copy right after publishing, so it waits
//!   for the readers that loaded the old copy before the swap (a pick's lookup: microseconds, but
//!   a writer that must yield its core to wait can lose a whole time slice);
//! - [`SharedIndex::write_owned`] (the KV-event path) publishes and returns: the old copy records
//!   the change as owed and gets it at the start of the next write, by which time its readers
//!   have had a whole publication interval to leave. So readers never hold a writer for more than
//!   what is left of lookups that began one publication ago, and in the common case not at all.
//!
//! Invariants: the published copy holds every write; the unpublished one holds every write but
//! those it owes, in order, and is brought up to date (its owed changes applied, in order) before
//! anything else is applied to it; every change is a deterministic function of the index it is
//! applied to, applied once to each copy; a reader sees each write entirely or not at all; a
//! thread must not write while it holds a read guard of the same index (it would wait for
//! itself).

use parking_lot::Mutex;
use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};

use super::PrefixIndex;

/// A change the unpublished copy may owe: kept until the next write applies it.
pub type Change = Arc<dyn Fn(&mut PrefixIndex) + Send + Sync>;

/// The copy readers cannot see (always uniquely owned while the mutex is held, once its last
/// readers have left) and the changes it owes.
struct Spare {
    copy: Arc<PrefixIndex>,
    owed: Vec<Change>,
}

/// See the module documentation.
pub struct SharedIndex {
    published: ArcSwap<PrefixIndex>,
    spare: Mutex<Spare>,
}

impl std::fmt::Debug for SharedIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedIndex")
            .field("published", &self.published)
            .finish_non_exhaustive()
    }
}

impl SharedIndex {
    /// Two empty copies of `PrefixIndex::with_seed(max_blocks_per_rank, seed)`.
    pub fn with_seed(max_blocks_per_rank: u64, seed: u64) -> Self {
        SharedIndex {
            published: ArcSwap::from_pointee(PrefixIndex::with_seed(max_blocks_per_rank, seed)),
            spare: Mutex::new(Spare {
                copy: Arc::new(PrefixIndex::with_seed(max_blocks_per_rank, seed)),
                owed: Vec::new(),
            }),
        }
    }

    /// The published index. Hold the guard only for a lookup: a writer waits for it to drop
    /// before it can reuse the copy.
    pub fn read(&self) -> Guard<Arc<PrefixIndex>> {
        self.published.load()
    }

    /// Applies `change` to both copies (so it must do the same thing each time it is called on
    /// equal indexes) and publishes it; returns what its first call returned.
    pub fn write<R>(&self, change: impl Fn(&mut PrefixIndex) -> R) -> R {
        let mut spare = self.spare.lock();
        let result = change(catch_up(&mut spare));
        publish(&self.published, &mut spare);
        let _ = change(catch_up(&mut spare));
        result
    }

    /// Applies `change` to the unpublished copy and publishes it without waiting for the readers
    /// of the other copy, which owes the change until the next write. Returns what the call
    /// returned (the later one's result is dropped).
    pub fn write_owned<R, F>(&self, change: F) -> R
    where
        F: Fn(&mut PrefixIndex) -> R + Send + Sync + 'static,
    {
        let change = Arc::new(change);
        let mut spare = self.spare.lock();
        let result = change(catch_up(&mut spare));
        publish(&self.published, &mut spare);
        spare.owed.push(Arc::new(move |ix: &mut PrefixIndex| {
            let _ = change(ix);
        }));
        result
    }

    /// Changes the unpublished copy owes now (0 right after [`Self::write`]).
    pub fn owed(&self) -> usize {
        self.spare.lock().owed.len()
    }
}

/// The unpublished copy once its last readers are gone, with every change it owes applied.
fn catch_up(spare: &mut Spare) -> &mut PrefixIndex {
    let Spare { copy, owed } = spare;
    let ix = wait_exclusive(copy);
    for change in owed.drain(..) {
        change(ix);
    }
    ix
}

/// Publishes the unpublished copy; the one readers leave becomes the unpublished one.
fn publish(published: &ArcSwap<PrefixIndex>, spare: &mut Spare) {
    let mut old = published.swap(Arc::clone(&spare.copy));
    // `spare` becomes the copy readers just left; our reference to the new one goes.
    std::mem::swap(&mut spare.copy, &mut old);
    drop(old);
}

/// Waits until every other holder of `ix` is gone (readers finishing a lookup that started
/// before the copy was unpublished), then returns it.
fn wait_exclusive(ix: &mut Arc<PrefixIndex>) -> &mut PrefixIndex {
    let mut spins = 0u32;
    while Arc::strong_count(ix) > 1 || Arc::weak_count(ix) > 0 {
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    // Unique now and nobody can clone it again (unpublished, writer mutex held): no copy made.
    Arc::make_mut(ix)
}
