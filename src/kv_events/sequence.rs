//! Per-publisher sequence tracking: which batches to deliver, replay, or report lost.
//!
//! A vLLM publisher numbers its batches 0, 1, 2, … A subscriber that sees a jump asks the
//! publisher's replay socket for the missing range; a number that goes backwards means a new
//! publisher (the engine restarted, its cache is empty). The first batch a subscriber sees may be far
//! from 0: everything before it is replayed as far as the publisher's buffer reaches.

/// What to do with an incoming batch number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqAction {
    /// Deliver it: it is the next one.
    Deliver,
    /// Replay `[from, to)` first (from the replay socket), then deliver this one (`to`).
    Replay { from: u64, to: u64 },
    /// The publisher restarted: forget what it published before; then replay `[0, seq)` if `seq > 0`.
    Restarted { seq: u64 },
    /// Already delivered by a catch-up replay: drop it.
    Duplicate,
}

/// How long after a catch-up the live copies of the batches it replayed may still arrive (they
/// were queued on the socket while the replay ran, so they come within milliseconds). Past it, a
/// number inside the replayed range is a restarted publisher's, not a copy.
pub(crate) const COPY_WINDOW: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Debug, Default, Clone)]
pub struct SeqTracker {
    next: Option<u64>,
    /// After a catch-up replay of `[from, to)` that ended at the instant kept: live batches in
    /// that range are copies, for [`COPY_WINDOW`].
    replayed: Option<(u64, u64, std::time::Instant)>,
}

impl SeqTracker {
    /// Where a catch-up replay starts: after the last batch seen, or 0 for a new publisher.
    pub(crate) fn resume_from(&self) -> u64 {
        self.next.unwrap_or(0)
    }

    /// A catch-up replay delivered `[from, to)`: expect `to` next, and drop live copies of them.
    pub(crate) fn caught_up(&mut self, from: u64, to: u64, now: std::time::Instant) {
        if to > from {
            self.next = Some(to);
            self.replayed = Some((from, to, now));
        }
    }

    /// The action for batch `seq`; the tracker then expects `seq + 1`.
    pub(crate) fn observe(&mut self, seq: u64, now: std::time::Instant) -> SeqAction {
        if let Some((from, to, at)) = self.replayed {
            if (from..to).contains(&seq) && now.saturating_duration_since(at) < COPY_WINDOW {
                return SeqAction::Duplicate;
            }
            self.replayed = None;
        }
        let action = match self.next {
            None if seq == 0 => SeqAction::Deliver,
            None => SeqAction::Replay { from: 0, to: seq },
            Some(next) if seq == next => SeqAction::Deliver,
            Some(next) if seq > next => SeqAction::Replay {
                from: next,
                to: seq,
            },
            Some(_) => SeqAction::Restarted { seq },
        };
        self.next = Some(seq.wrapping_add(1));
        action
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// One instant for the tests that do not move the clock.
    fn t0() -> Instant {
        static AT: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *AT.get_or_init(Instant::now)
    }

    #[test]
    fn in_order_gap_restart_and_late_start() {
        let mut t = SeqTracker::default();
        assert_eq!(t.observe(0, t0()), SeqAction::Deliver);
        assert_eq!(t.observe(1, t0()), SeqAction::Deliver);
        assert_eq!(t.observe(4, t0()), SeqAction::Replay { from: 2, to: 4 });
        assert_eq!(t.observe(5, t0()), SeqAction::Deliver);
        assert_eq!(t.observe(0, t0()), SeqAction::Restarted { seq: 0 });
        assert_eq!(t.observe(1, t0()), SeqAction::Deliver);
        // Restarted and already past 0 by the time we hear from it.
        assert_eq!(t.observe(1, t0()), SeqAction::Restarted { seq: 1 });
        let mut late = SeqTracker::default();
        assert_eq!(late.observe(7, t0()), SeqAction::Replay { from: 0, to: 7 });
        assert_eq!(late.observe(8, t0()), SeqAction::Deliver);
    }

    #[test]
    fn catch_up_resumes_after_the_last_batch_and_drops_live_copies() {
        let mut t = SeqTracker::default();
        assert_eq!(t.resume_from(), 0, "a new publisher is read from the start");
        t.caught_up(0, 3, t0());
        assert_eq!(t.resume_from(), 3);
        assert_eq!(t.observe(1, t0()), SeqAction::Duplicate);
        assert_eq!(t.observe(2, t0()), SeqAction::Duplicate);
        assert_eq!(t.observe(3, t0()), SeqAction::Deliver);
        // Once past the replayed range, going back is a restart again.
        assert_eq!(t.observe(1, t0()), SeqAction::Restarted { seq: 1 });
        // An empty catch-up changes nothing.
        let mut e = SeqTracker::default();
        e.caught_up(0, 0, t0());
        assert_eq!(e.observe(0, t0()), SeqAction::Deliver);
    }

    /// A restarted publisher numbers its batches from 0 again: once the catch-up's copies have had
    /// their time, a number inside the replayed range is a restart, not a copy.
    #[test]
    fn a_number_in_the_replayed_range_after_the_copy_window_is_a_restart() {
        let mut t = SeqTracker::default();
        t.caught_up(0, 1, t0());
        assert_eq!(t.observe(0, t0() + COPY_WINDOW / 2), SeqAction::Duplicate);
        let mut t = SeqTracker::default();
        t.caught_up(0, 1, t0());
        assert_eq!(
            t.observe(0, t0() + COPY_WINDOW + Duration::from_millis(1)),
            SeqAction::Restarted { seq: 0 }
        );
    }
}
