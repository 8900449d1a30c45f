//! A [`PrefixIndex`] that readers never wait for: two copies, left-right style.
//!
//! Readers load the published copy ([`SharedIndex::read`], an `arc-swap` load: no lock, no
//! waiting on writers). A writer applies its change to the unpublished copy, publishes it, waits
//! until the readers still holding the old copy have finished with it (a pick's lookup: micro-
//! seconds), then applies the same change to the old copy, which becomes the next unpublished
//! one. Writers serialize among themselves on one mutex and pay every change twice; readers pay
//! one atomic load.
//!
//! Invariants: between writes both copies hold the same content (every change is a deterministic
//! function of the index it is applied to, applied once to each); a reader sees each write
//! entirely or not at all; a thread must not write while it holds a read guard of the same index
//! (it would wait for itself).

use parking_lot::Mutex;
use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};

use super::PrefixIndex;

/// See the module documentation.
#[derive(Debug)]
pub struct SharedIndex {
    published: ArcSwap<PrefixIndex>,
    /// The copy readers cannot see (always uniquely owned while the mutex is held).
    spare: Mutex<Arc<PrefixIndex>>,
}

impl SharedIndex {
    /// Two empty copies of `PrefixIndex::with_seed(max_blocks_per_rank, seed)`.
    pub fn with_seed(max_blocks_per_rank: u64, seed: u64) -> Self {
        SharedIndex {
            published: ArcSwap::from_pointee(PrefixIndex::with_seed(max_blocks_per_rank, seed)),
            spare: Mutex::new(Arc::new(PrefixIndex::with_seed(max_blocks_per_rank, seed))),
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
        let result = change(wait_exclusive(&mut spare));
        let mut old = self.published.swap(Arc::clone(&spare));
        // `spare` becomes the copy readers just left; our reference to the new one goes.
        std::mem::swap(&mut *spare, &mut old);
        drop(old);
        let _ = change(wait_exclusive(&mut spare));
        result
    }
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
