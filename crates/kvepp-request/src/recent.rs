//! The last few long texts a model's requests brought (rendered chat prompts, `messages` arrays),
//! each with what was worked out from it, so that a text which starts like one of them (a
//! conversation's next turn repeats every earlier turn) is worked on only from near where the two
//! differ: the common part costs one comparison of bytes, not another pass of the work.
//!
//! What it owns: up to [`WAYS`] kept entries (texts of [`MIN_SHARED`] to [`MAX_TEXT`] bytes),
//! most recently kept first, and the counts of texts that resumed from one and that could not.
//! What of an entry may be reused for a given common part is the caller's to say
//! ([`Recent::resume`]'s `usable`).
//!
//! The comparison is the core's [`common_prefix`] (long runs by `memcmp`).
//!
//! Invariants: an entry is never changed once kept (readers hold it by `Arc`, so one being
//! replaced stays valid for a request comparing against it); the lock is held only to copy or
//! swap the handles, never while comparing; a lookup compares at most about twice its text's
//! length in all.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvepp_core::hash::common_prefix;
use parking_lot::Mutex;

use crate::generations::CacheStats;

/// Entries kept per cache: a few conversations interleaving behind one system prompt each find
/// their own previous turn.
const WAYS: usize = 8;
/// Texts longer than this are not kept (memory: at most `WAYS` × 2 MiB of text, and what was
/// worked out from it).
const MAX_TEXT: usize = 2 << 20;
/// Texts shorter than this, or sharing less than this with every kept one, are worked on from
/// the start (the comparison would save little).
const MIN_SHARED: usize = 4 << 10;

/// An entry: its text and whatever was worked out from it.
pub trait Kept {
    fn text(&self) -> &[u8];
}

/// Where a text resumes: the kept entry it shares `shared` leading bytes with, and what of that
/// entry the caller found usable.
pub struct Resume<E, R> {
    pub from: Arc<E>,
    pub usable: R,
    pub shared: usize,
}

#[derive(Debug)]
pub struct Recent<E> {
    ways: Mutex<Vec<Arc<E>>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl<E> Default for Recent<E> {
    fn default() -> Self {
        Recent {
            ways: Mutex::new(Vec::with_capacity(WAYS)),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }
}

impl<E: Kept> Recent<E> {
    /// The kept entry `text` shares the most leading bytes with (most recent first; the first
    /// that shares 15/16 of `text` is taken: entries kept from requests in flight together often
    /// all share nearly everything, and comparing each would cost a pass over the text apiece),
    /// and what `usable` makes of it for that many shared bytes. None (counted a
    /// miss) when none shares [`MIN_SHARED`] bytes or `usable` finds nothing; a text shorter than
    /// that is not looked up (nor counted).
    pub fn resume<R>(
        &self,
        text: &[u8],
        usable: impl FnOnce(&E, usize) -> Option<R>,
    ) -> Option<Resume<E, R>> {
        if text.len() < MIN_SHARED {
            return None;
        }
        let mut kept: [Option<Arc<E>>; WAYS] = Default::default();
        for (slot, e) in kept.iter_mut().zip(self.ways.lock().iter()) {
            *slot = Some(e.clone());
        }
        let mut best: Option<(usize, Arc<E>)> = None;
        let mut budget = 2 * text.len();
        for e in kept.into_iter().flatten() {
            let shared = common_prefix(text, e.text());
            budget = budget.saturating_sub(shared.max(1));
            if best.as_ref().is_none_or(|(s, _)| shared > *s) {
                best = Some((shared, e));
            }
            if shared * 16 >= text.len() * 15 || budget == 0 {
                break;
            }
        }
        let found = best
            .filter(|(shared, _)| *shared >= MIN_SHARED)
            .and_then(|(shared, from)| {
                let usable = usable(&from, shared)?;
                Some(Resume {
                    from,
                    usable,
                    shared,
                })
            });
        let counter = if found.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        found
    }

    /// Keeps `entry`, most recent first: in place of the entry it resumed from when it carries
    /// on from that one (shares at least half of it: the same conversation, a turn later), else
    /// in place of the least recently kept. Too short or too long a text is not kept.
    pub fn remember<R>(&self, resumed: Option<&Resume<E, R>>, entry: E) {
        if !(MIN_SHARED..=MAX_TEXT).contains(&entry.text().len()) {
            return;
        }
        let entry = Arc::new(entry);
        let dropped = {
            let mut ways = self.ways.lock();
            let replaced = resumed
                .filter(|r| r.shared * 2 >= r.from.text().len())
                .and_then(|r| ways.iter().position(|w| Arc::ptr_eq(w, &r.from)));
            let out = match replaced {
                Some(i) => Some(ways.remove(i)),
                None if ways.len() >= WAYS => ways.pop(),
                None => None,
            };
            ways.insert(0, entry);
            out
        };
        // A dropped entry is freed outside the lock.
        drop(dropped);
    }

    /// Forgets every kept entry.
    pub fn clear(&self) {
        self.ways.lock().clear();
    }

    /// Texts that resumed from a kept one (hits) and long enough ones that could not (misses).
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A text and the offsets worked out from it.
    struct Marks(Vec<u8>, Vec<usize>);

    impl Kept for Marks {
        fn text(&self) -> &[u8] {
            &self.0
        }
    }

    /// The last mark at least 16 bytes inside the shared part.
    fn last_safe(m: &Marks, shared: usize) -> Option<usize> {
        m.1.iter().rev().copied().find(|&e| e + 16 <= shared)
    }

    #[test]
    fn resumes_from_the_entry_sharing_the_most_and_stays_bounded() {
        let recent = Recent::default();
        let base = vec![b'a'; 3 * MIN_SHARED];
        recent.remember::<()>(
            None,
            Marks(base.clone(), vec![100, MIN_SHARED, 2 * MIN_SHARED]),
        );
        let mut other = base.clone();
        other[MIN_SHARED + 10] = b'z';
        recent.remember::<()>(None, Marks(other, vec![50]));
        let mut text = base.clone();
        text.extend_from_slice(b"and more");
        // The most recent (`other`) shares less than 15/16: the older one is read too.
        let r = recent.resume(&text, last_safe).expect("resumes");
        assert_eq!((r.shared, r.usable), (base.len(), 2 * MIN_SHARED));
        // The most recent entry that shares 15/16 is taken without reading older ones.
        let mut near = text.clone();
        near.truncate(text.len() - 5);
        recent.remember::<()>(None, Marks(near, vec![200]));
        let first = recent.resume(&text, last_safe).expect("resumes");
        assert_eq!(first.usable, 200);
        recent.ways.lock().remove(0);
        // A turn later: kept in place of the entry it carried on from.
        recent.remember(Some(&r), Marks(text.clone(), vec![100]));
        assert_eq!(recent.ways.lock().len(), 2);
        assert!(recent.resume(b"short", last_safe).is_none());
        let unrelated = vec![b'q'; 2 * MIN_SHARED];
        assert!(recent.resume(&unrelated, last_safe).is_none());
        assert!(
            recent.resume(&text, |_, _| None::<()>).is_none(),
            "nothing usable"
        );
        assert_eq!(recent.stats().hits, 2);
        assert_eq!(recent.stats().misses, 2, "a short text is not counted");
        for i in 0..2 * WAYS {
            let mut t = vec![b'b'; MIN_SHARED];
            t.extend_from_slice(i.to_string().as_bytes());
            recent.remember::<()>(None, Marks(t, vec![]));
        }
        assert_eq!(recent.ways.lock().len(), WAYS, "bounded");
        recent.remember::<()>(None, Marks(vec![b'c'; MAX_TEXT + 1], vec![]));
        assert!(recent
            .ways
            .lock()
            .iter()
            .all(|e| e.text().len() <= MAX_TEXT));
    }
}
