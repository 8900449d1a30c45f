//! A model's last few rendered chat prompts, each with the pieces it was cut into and the points
//! where cutting could resume, so that a prompt which starts like one of them (a conversation's
//! next turn renders every earlier turn again) is cut and looked up only from near where the two
//! differ: the common part is one comparison of bytes, not a pass of the added-token search and
//! a 128-bit hash of every segment.
//!
//! What it owns: up to [`WAYS`] renders (each at most [`MAX_TEXT`] bytes, with its pieces), most
//! recently used first, and the counts of renders that resumed from one and that could not.
//!
//! Invariants: a render is kept whole and never changed once kept (readers hold it by `Arc`, so
//! one being replaced stays valid for a pick comparing against it); a cut names a point just
//! after an added token and how many pieces the render had there; the caller decides which cuts
//! the common part makes safe ([`super::SegmentTokenizer`]). The lock is held only to copy or
//! swap the handles, never while comparing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::SegmentStats;

/// Renders kept per model: a few conversations interleaving behind one system prompt each find
/// their own previous turn.
const WAYS: usize = 8;
/// Renders longer than this are cut but not kept (memory: at most `WAYS` × 2 MiB of text, and
/// the pieces' ids, which the segment cache shares).
const MAX_TEXT: usize = 2 << 20;
/// Prompts shorter than this, or sharing less than this with every kept render, are cut from the
/// start (the comparison would save little).
const MIN_SHARED: usize = 4 << 10;

/// A point where cutting may resume: just after an added token ending at byte `end`, with the
/// render's first `pieces` pieces (that token's own included) before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Cut {
    pub end: usize,
    pub pieces: usize,
}

/// A rendered prompt as it was cut.
#[derive(Debug)]
pub(super) struct Render {
    pub text: Vec<u8>,
    pub pieces: Vec<Arc<[u32]>>,
    /// In text order.
    pub cuts: Vec<Cut>,
}

/// Where a prompt resumes: the kept render it shares `shared` leading bytes with, and the index
/// of the last of that render's cuts the caller accepted.
pub(super) struct Resume {
    pub from: Arc<Render>,
    pub cut: usize,
    pub shared: usize,
}

#[derive(Debug, Default)]
pub(super) struct RecentRenders {
    ways: Mutex<Vec<Arc<Render>>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl RecentRenders {
    /// The kept render `text` shares the most leading bytes with, and its last cut that `safe`
    /// accepts for that many shared bytes (cuts are in text order and `safe` is monotone); None
    /// (counted a miss) when no kept render shares [`MIN_SHARED`] bytes or no cut is safe.
    pub fn resume(&self, text: &[u8], safe: impl Fn(&Cut, usize) -> bool) -> Option<Resume> {
        if text.len() < MIN_SHARED {
            return None;
        }
        let mut kept: [Option<Arc<Render>>; WAYS] = Default::default();
        for (slot, r) in kept.iter_mut().zip(self.ways.lock().iter()) {
            *slot = Some(r.clone());
        }
        // Most recent first; the first that shares at least half of `text` is taken (a turn of
        // the same conversation: renders kept from requests in flight together often all share
        // nearly everything, and comparing each would cost a pass over the text apiece), and
        // at most about twice `text`'s length is compared in all.
        let mut best: Option<(usize, Arc<Render>)> = None;
        let mut budget = 2 * text.len();
        for r in kept.into_iter().flatten() {
            let shared = common_prefix(text, &r.text);
            budget = budget.saturating_sub(shared.max(1));
            if best.as_ref().is_none_or(|(s, _)| shared > *s) {
                best = Some((shared, r));
            }
            if shared * 2 >= text.len() || budget == 0 {
                break;
            }
        }
        let found = best
            .filter(|(shared, _)| *shared >= MIN_SHARED)
            .and_then(|(shared, r)| {
                let cut = r.cuts.partition_point(|c| safe(c, shared)).checked_sub(1)?;
                Some(Resume {
                    from: r,
                    cut,
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

    /// Keeps `render`, most recent first: in place of the render it resumed from when it carries
    /// on from that one (shares at least half of it: the same conversation, a turn later), else
    /// in place of the least recently kept. Too short or too long a render is not kept.
    pub fn remember(&self, resumed: Option<&Resume>, render: Render) {
        if !(MIN_SHARED..=MAX_TEXT).contains(&render.text.len()) {
            return;
        }
        let render = Arc::new(render);
        let dropped = {
            let mut ways = self.ways.lock();
            let replaced = resumed
                .filter(|r| r.shared * 2 >= r.from.text.len())
                .and_then(|r| ways.iter().position(|w| Arc::ptr_eq(w, &r.from)));
            let out = match replaced {
                Some(i) => Some(ways.remove(i)),
                None if ways.len() >= WAYS => ways.pop(),
                None => None,
            };
            ways.insert(0, render);
            out
        };
        // A dropped render's text and pieces are freed outside the lock.
        drop(dropped);
    }

    /// Renders that resumed from a kept one (hits) and long enough ones that could not (misses).
    pub fn stats(&self) -> SegmentStats {
        SegmentStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
        }
    }
}

/// How many leading bytes `a` and `b` share: compared a block at a time (the slice comparison is
/// the C library's vectorised one), then byte by byte within the first block that differs.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    const BLOCK: usize = 512;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + BLOCK <= n && a[i..i + BLOCK] == b[i..i + BLOCK] {
        i += BLOCK;
    }
    i + a[i..n]
        .iter()
        .zip(&b[i..n])
        .take_while(|(x, y)| x == y)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_prefix_counts_equal_leading_bytes() {
        let mut rng = fastrand::Rng::with_seed(3);
        for _ in 0..300 {
            let len = rng.usize(..3000);
            let a: Vec<u8> = (0..len).map(|_| rng.u8(b'a'..=b'c')).collect();
            let mut b = a.clone();
            b.truncate(rng.usize(..=len));
            if !b.is_empty() && rng.bool() {
                let at = rng.usize(..b.len());
                b[at] = b'x';
            }
            let want = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
            assert_eq!(common_prefix(&a, &b), want);
            assert_eq!(common_prefix(&b, &a), want);
        }
    }

    fn render(text: Vec<u8>, cuts: &[usize]) -> Render {
        Render {
            pieces: cuts.iter().map(|&e| Arc::from([e as u32])).collect(),
            cuts: cuts
                .iter()
                .enumerate()
                .map(|(i, &end)| Cut { end, pieces: i + 1 })
                .collect(),
            text,
        }
    }

    #[test]
    fn resumes_from_the_render_sharing_the_most_at_its_last_safe_cut() {
        let recent = RecentRenders::default();
        let base = vec![b'a'; 3 * MIN_SHARED];
        recent.remember(
            None,
            render(base.clone(), &[100, MIN_SHARED, 2 * MIN_SHARED]),
        );
        let mut other = base.clone();
        other[MIN_SHARED + 10] = b'z';
        recent.remember(None, render(other, &[50]));
        let mut text = base.clone();
        text.extend_from_slice(b"and more");
        // Safe: cuts at least 16 bytes inside the shared part.
        let r = recent
            .resume(&text, |c, shared| c.end + 16 <= shared)
            .expect("resumes");
        assert_eq!(r.shared, base.len());
        assert_eq!(
            r.from.cuts[r.cut],
            Cut {
                end: 2 * MIN_SHARED,
                pieces: 3
            }
        );
        // The most recent render that shares half is taken without reading older ones.
        let mut near = text.clone();
        near.truncate(text.len() - 5);
        recent.remember(None, render(near, &[200]));
        let first = recent
            .resume(&text, |c, shared| c.end + 16 <= shared)
            .expect("resumes");
        assert_eq!(
            first.from.cuts[first.cut],
            Cut {
                end: 200,
                pieces: 1
            }
        );
        recent.ways.lock().remove(0);
        // A turn later: kept in place of the render it carried on from.
        recent.remember(Some(&r), render(text.clone(), &[100]));
        assert_eq!(recent.ways.lock().len(), 2);
        assert!(recent.resume(b"short", |_, _| true).is_none());
        let unrelated = vec![b'q'; 2 * MIN_SHARED];
        assert!(recent.resume(&unrelated, |_, _| true).is_none());
        assert_eq!(recent.stats().hits, 2);
        assert_eq!(recent.stats().misses, 1, "a short prompt is not counted");
        for i in 0..2 * WAYS {
            let mut t = vec![b'b'; MIN_SHARED];
            t.extend_from_slice(i.to_string().as_bytes());
            recent.remember(None, render(t, &[]));
        }
        assert_eq!(recent.ways.lock().len(), WAYS, "bounded");
        recent.remember(None, render(vec![b'c'; MAX_TEXT + 1], &[]));
        assert!(recent.ways.lock().iter().all(|r| r.text.len() <= MAX_TEXT));
    }
}
