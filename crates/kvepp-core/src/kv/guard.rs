//! A pick's slot-tracker booking, held for the request's life: [`SlotGuard`].
//!
//! Invariants: the booking is freed exactly once (on drop), prefill completes at most once, and the
//! TTFT and decode models learn from a request at most once each (the decode model only after its
//! first token was seen); the state's listeners hear each of them (a free only when the entry was
//! still there: one that expired was not freed by this guard).

use std::sync::Arc;
use std::time::Instant;

use super::KvState;
use crate::decode::DecodeFeatures;
use crate::predict::{EndpointSpeed, TtftFeatures};

/// One request's slot-tracker booking: prefill until [`SlotGuard::first_byte`], freed on drop.
#[derive(Debug)]
pub struct SlotGuard {
    pub(super) state: Arc<KvState>,
    /// The slot tracker's request id (None when booking failed).
    pub(super) id: Option<Arc<str>>,
    pub(super) prefill_done: bool,
    /// A pick by predicted TTFT: the endpoint's speed, what the prediction read, when booked.
    pub(super) learn: Option<(Arc<EndpointSpeed>, TtftFeatures, Instant)>,
    /// A pick by predicted completion: what its decode prediction read and the request's model.
    pub(super) decode: Option<(DecodeFeatures, Option<Arc<str>>)>,
    /// When the first token came (the decode model learns from it to the end).
    pub(super) first_token_at: Option<Instant>,
}

impl SlotGuard {
    /// The slot tracker's id of this booking.
    pub fn id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    /// The first token arrived at `now`: the endpoint's TTFT model learns what it took. Once.
    pub fn first_token(&mut self, now: Instant) {
        if self.first_token_at.is_none() {
            self.first_token_at = Some(now);
        }
        if let Some((speed, f, at)) = self.learn.take() {
            let ms = now.saturating_duration_since(at).as_secs_f64() * 1000.0;
            self.state.ttft.observe(&speed, &f, ms, now);
        }
    }

    /// The response ended at `now` after `output_tokens`: the decode model learns the mean step
    /// since the first token, and the model's output length. Once; nothing without a first token.
    pub fn finished(&mut self, now: Instant, output_tokens: u64) {
        let Some(first) = self.first_token_at else {
            return;
        };
        if let Some((f, model)) = self.decode.take() {
            let ms = now.saturating_duration_since(first).as_secs_f64() * 1000.0;
            self.state
                .decode
                .observe(model.as_deref(), &f, output_tokens, ms);
        }
    }

    pub fn first_byte(&mut self) {
        if let (Some(id), false) = (&self.id, self.prefill_done) {
            self.prefill_done = true;
            let _ = self.state.slots.prefill_complete(id);
            self.state.hub.each(|l| l.prefill_complete(id));
        }
    }

    /// One more output block (decode load grows); local only, never published.
    pub fn output_block(&self, decay_fraction: Option<f64>) -> Result<(), crate::slots::SlotError> {
        match &self.id {
            Some(id) => self.state.slots.add_output_block(id, decay_fraction),
            None => Ok(()),
        }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if let Some(id) = &self.id {
            if self.state.slots.free(id) {
                self.state.hub.each(|l| l.freed(id));
            }
        }
    }
}

/// The id of the `n`-th booking made without one: NUL and `n` in decimal, which no client of
/// the HTTP services can have booked (their ids are text). One allocation, no formatter.
pub(super) fn local_id(mut n: u64) -> Arc<str> {
    // NUL and up to 20 digits.
    let mut buf = [0u8; 21];
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    at -= 1;
    buf[at] = 0;
    // ASCII: always UTF-8.
    Arc::from(std::str::from_utf8(&buf[at..]).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    #[test]
    fn local_ids_are_nul_and_the_number() {
        for n in [0, 7, 10, 12_345, u64::MAX] {
            assert_eq!(&*super::local_id(n), format!("\0{n}"));
        }
    }
}
