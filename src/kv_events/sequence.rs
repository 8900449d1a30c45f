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
}

#[derive(Debug, Default, Clone)]
pub struct SeqTracker {
    next: Option<u64>,
}

impl SeqTracker {
    /// The action for batch `seq`; the tracker then expects `seq + 1`.
    pub fn observe(&mut self, seq: u64) -> SeqAction {
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

    #[test]
    fn in_order_gap_restart_and_late_start() {
        let mut t = SeqTracker::default();
        assert_eq!(t.observe(0), SeqAction::Deliver);
        assert_eq!(t.observe(1), SeqAction::Deliver);
        assert_eq!(t.observe(4), SeqAction::Replay { from: 2, to: 4 });
        assert_eq!(t.observe(5), SeqAction::Deliver);
        assert_eq!(t.observe(0), SeqAction::Restarted { seq: 0 });
        assert_eq!(t.observe(1), SeqAction::Deliver);
        // Restarted and already past 0 by the time we hear from it.
        assert_eq!(t.observe(1), SeqAction::Restarted { seq: 1 });
        let mut late = SeqTracker::default();
        assert_eq!(late.observe(7), SeqAction::Replay { from: 0, to: 7 });
        assert_eq!(late.observe(8), SeqAction::Deliver);
    }
}
