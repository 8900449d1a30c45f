//! A [`PrefixIndex`] that readers never wait for: two copies, left-right style.
//!
//! Readers load the published copy ([`SharedIndex::read`], an `arc-swap` load: no lock, no
//! waiting on writers). A writer applies its change to the unpublished copy and publishes it; the
//! copy readers just left becomes the unpublished one and must get the same change before it is
//! written again. Writers serialize among themselves on one mutex and pay every change twice;
//! readers pay one atomic load.
//!
//! Three ways to write:
//! - [`SharedIndex::write`] applies the change to the old copy right after publishing, so it waits
//!   for the readers that loaded the old copy before the swap (a pick's lookup: microseconds, but
//!   a writer that must yield its core to wait can lose a whole time slice);
//! - [`SharedIndex::write_owned`] publishes and returns: the old copy records the change as owed
//!   and gets it at the start of the next write, by which time its readers have had a whole
//!   publication interval to leave;
//! - [`SharedIndex::submit`] (the KV-event path) queues the change and returns at once if another
//!   thread is publishing: that thread takes every queued change into its publication (flat
//!   combining). Changes that arrive while one publication is prepared go out together in the
//!   next, so the number of publications (and of waits for readers) per second stays bounded
//!   however many changes arrive, and a submitter never waits behind another.
//!
//! How long readers can hold a writer: a publication waits only for readers that loaded the copy
//! *before the previous publication* and are still reading it (a lookup that began one
//! publication ago); never for readers of the published copy. A reader that was preempted while
//! holding an old copy can hold the writer for that long; the writer then sleeps instead of
//! spinning, so it does not keep the preempted reader off its core.
//!
//! Invariants: the published copy holds every write; the unpublished one holds every write but
//! those it owes, in order, and is brought up to date (its owed changes applied, in order) before
//! anything else is applied to it; every change is a deterministic function of the index it is
//! applied to, applied once to each copy; a reader sees each write entirely or not at all; queued
//! changes are published in the order they were queued, before any later `write`'s change, and
//! each one's report runs exactly once, after its publication; a thread must not write while it
//! holds a read guard of the same index (it would wait for itself).

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::{ArcSwap, Guard};

use super::PrefixIndex;

/// A change the unpublished copy may owe: kept until the next write applies it.
pub type Change = Arc<dyn Fn(&mut PrefixIndex) + Send + Sync>;

/// What runs once a queued change is published (its result, e.g. into metrics).
type Report = Box<dyn FnOnce() + Send>;

/// A queued change: its first application (whose result the report takes) and the change the
/// other copy will owe.
struct Queued {
    first: Box<dyn FnOnce(&mut PrefixIndex) -> Report + Send>,
    owed: Change,
}

/// The copy readers cannot see (always uniquely owned while the mutex is held, once its last
/// readers have left) and the changes it owes.
struct Spare {
    copy: Arc<PrefixIndex>,
    owed: Vec<Change>,
}

/// See the module documentation.
pub struct SharedIndex {
    published: ArcSwap<PrefixIndex>,
    /// The published copy's [`PrefixIndex::slot_epoch`], stored at each publication.
    slot_epoch: AtomicU64,
    spare: Mutex<Spare>,
    /// Changes submitted and not yet taken into a publication.
    queue: Mutex<Vec<Queued>>,
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
            slot_epoch: AtomicU64::new(0),
            spare: Mutex::new(Spare {
                copy: Arc::new(PrefixIndex::with_seed(max_blocks_per_rank, seed)),
                owed: Vec::new(),
            }),
            queue: Mutex::new(Vec::new()),
        }
    }

    /// The published copy's slot epoch ([`PrefixIndex::slot_epoch`]; it may lag a reader's
    /// copy for the moment of a publication): one atomic load, no guard.
    pub fn slot_epoch(&self) -> u64 {
        self.slot_epoch.load(Ordering::Acquire)
    }

    /// The published index. Hold the guard only for a lookup: a writer waits for it to drop
    /// before it can reuse the copy.
    pub fn read(&self) -> Guard<Arc<PrefixIndex>> {
        self.published.load()
    }

    /// Applies `change` to both copies (so it must do the same thing each time it is called on
    /// equal indexes) and publishes it; returns what its first call returned. Changes queued
    /// before it are published with it, ahead of it.
    pub fn write<R>(&self, change: impl Fn(&mut PrefixIndex) -> R) -> R {
        let mut spare = self.spare.lock();
        let (reports, result) = self.publish_queued(&mut spare, &change);
        let _ = change(catch_up(&mut spare));
        drop(spare);
        run(reports);
        self.flush();
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
        let (reports, result) = self.publish_queued(&mut spare, &*change);
        spare.owed.push(Arc::new(move |ix: &mut PrefixIndex| {
            let _ = change(ix);
        }));
        drop(spare);
        run(reports);
        self.flush();
        result
    }

    /// Queues `change` (applied to each copy, like [`Self::write_owned`]'s) and publishes every
    /// queued change unless another thread is publishing, which then takes this one too. `report`
    /// gets the first call's result once the change is published (by whichever thread published
    /// it).
    pub fn submit<R, F, P>(&self, change: F, report: P)
    where
        R: Send + 'static,
        F: Fn(&mut PrefixIndex) -> R + Send + Sync + 'static,
        P: FnOnce(R) + Send + 'static,
    {
        self.enqueue(change, report);
        self.flush();
    }

    /// Queues `change` without publishing it: the next [`Self::flush`], [`Self::submit`] or write
    /// publishes it with whatever else is queued (a writer with many changes at hand queues them
    /// all, then flushes once).
    pub fn enqueue<R, F, P>(&self, change: F, report: P)
    where
        R: Send + 'static,
        F: Fn(&mut PrefixIndex) -> R + Send + Sync + 'static,
        P: FnOnce(R) + Send + 'static,
    {
        let change = Arc::new(change);
        let first = Arc::clone(&change);
        self.queue.lock().push(Queued {
            first: Box::new(move |ix| {
                let r = first(ix);
                Box::new(move || report(r))
            }),
            owed: Arc::new(move |ix: &mut PrefixIndex| {
                let _ = change(ix);
            }),
        });
    }

    /// Publishes every queued change in one publication, unless another thread holds the writer
    /// (it publishes them: it looks at the queue again after it lets go).
    pub fn flush(&self) {
        loop {
            if self.queue.lock().is_empty() {
                return;
            }
            let Some(mut spare) = self.spare.try_lock() else {
                return;
            };
            let (reports, ()) = self.publish_queued(&mut spare, &|_| ());
            drop(spare);
            run(reports);
        }
    }

    /// Changes the unpublished copy owes now (0 right after [`Self::write`]).
    pub fn owed(&self) -> usize {
        self.spare.lock().owed.len()
    }

    /// Changes queued and not yet published.
    pub fn queued(&self) -> usize {
        self.queue.lock().len()
    }

    /// Brings the spare up to date, applies the queued changes and then `change` to it, and
    /// publishes it; the other copy then owes the queued changes (not `change`: the caller
    /// decides). Returns the queued changes' reports (to run once the writer's lock is let go)
    /// and `change`'s result.
    fn publish_queued<R>(
        &self,
        spare: &mut Spare,
        change: &dyn Fn(&mut PrefixIndex) -> R,
    ) -> (Vec<Report>, R) {
        let queued = std::mem::take(&mut *self.queue.lock());
        let ix = catch_up(spare);
        let mut reports = Vec::with_capacity(queued.len());
        let mut owed = Vec::with_capacity(queued.len());
        for q in queued {
            reports.push((q.first)(ix));
            owed.push(q.owed);
        }
        let result = change(ix);
        publish(&self.published, spare);
        self.slot_epoch
            .store(self.published.load().slot_epoch(), Ordering::Release);
        spare.owed = owed;
        (reports, result)
    }
}

fn run(reports: Vec<Report>) {
    for r in reports {
        r();
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
/// before the copy was unpublished), then returns it. Spins briefly, then sleeps: a reader still
/// holding the copy after that was most likely preempted, and needs a core to finish.
fn wait_exclusive(ix: &mut Arc<PrefixIndex>) -> &mut PrefixIndex {
    let mut spins = 0u32;
    while Arc::strong_count(ix) > 1 || Arc::weak_count(ix) > 0 {
        spins += 1;
        if spins < 128 {
            std::hint::spin_loop();
        } else if spins < 136 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
    // Unique now and nobody can clone it again (unpublished, writer mutex held): no copy made.
    Arc::make_mut(ix)
}
