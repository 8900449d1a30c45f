//! The guard of a routing decision: [`Booking`], the only way load booked by the router is
//! released.
//!
//! What it owns: one request's in-flight count on its endpoint, its slot-tracker entry (a
//! KV-aware pick's [`SlotGuard`]), a disaggregated pick's prefill leg, and the [`Hub`] of the
//! router that made it. Invariants: the in-flight count is taken once when the booking is made and
//! given back exactly once, when it is dropped (normal end, client abort, proxy reset, EPP error,
//! a reservation freed or expired); the first response byte is counted at most once; every release
//! tells the hub's listeners (flow control wakes, replica sync publishes the free), so no caller
//! pairs a release with a notification of its own. A preview's booking ([`Booking::none`]) holds
//! nothing and tells no one.

use std::sync::Arc;
use std::time::Instant;

use crate::kv::SlotGuard;
use crate::listen::Hub;
use crate::load::EndpointLoad;

/// One request's slot on an endpoint. Dropping it ends the request.
#[derive(Debug)]
pub struct Booking {
    /// None: a preview's booking, which holds nothing.
    load: Option<Arc<EndpointLoad>>,
    first_byte_seen: bool,
    /// The KV-aware picker's slot-tracker booking, when it picked.
    slot: Option<SlotGuard>,
    /// A disaggregated pick's prefill leg: released when the response starts (the prefill worker
    /// has handed the KV cache over by then) or with this booking.
    prefill: Option<Box<Booking>>,
    /// Told when this booking releases its load.
    hub: Option<Arc<Hub>>,
}

impl EndpointLoad {
    /// Books one request on this endpoint, outside any router (tests, and load other than a
    /// pick's): no listener hears its release.
    pub fn book(self: &Arc<Self>) -> Booking {
        Booking::new(self, None)
    }
}

impl Booking {
    /// Books one request on `load`; its release tells `hub`.
    pub(crate) fn new(load: &Arc<EndpointLoad>, hub: Option<Arc<Hub>>) -> Self {
        load.admit();
        Booking {
            load: Some(load.clone()),
            first_byte_seen: false,
            slot: None,
            prefill: None,
            hub,
        }
    }

    /// A booking that holds nothing (a decision previewed, not booked).
    pub fn none() -> Self {
        Booking {
            load: None,
            first_byte_seen: true,
            slot: None,
            prefill: None,
            hub: None,
        }
    }

    /// Adds the slot-tracker booking of a KV-aware pick (released with this booking).
    pub fn with_slot(mut self, slot: SlotGuard) -> Self {
        self.slot = Some(slot);
        self
    }

    /// Adds the prefill leg of a disaggregated pick (released at the first response byte).
    pub fn with_prefill(mut self, prefill: Booking) -> Self {
        self.prefill = Some(Box::new(prefill));
        self
    }

    /// Whether the prefill leg of a disaggregated pick is still booked.
    pub fn prefill_pending(&self) -> bool {
        self.prefill.is_some()
    }

    /// The response has started (prefill is over, in engine terms). Idempotent.
    pub fn first_byte(&mut self) {
        self.prefill = None;
        if let Some(s) = &mut self.slot {
            s.first_byte();
        }
        if !self.first_byte_seen {
            self.first_byte_seen = true;
            if let Some(l) = &self.load {
                l.first_byte_done();
            }
        }
    }

    /// One more output block was generated (the selection services' `output_block`): the
    /// slot tracker's decode load grows (`decay_fraction`: Dynamo's decay of older blocks).
    pub fn output_block(&self, decay_fraction: Option<f64>) -> Result<(), crate::slots::SlotError> {
        match &self.slot {
            Some(s) => s.output_block(decay_fraction),
            None => Ok(()),
        }
    }

    /// The first token arrived at `now` (a streamed response's first chunk): a pick by predicted
    /// TTFT teaches the endpoint's model what it took. Once.
    pub fn first_token(&mut self, now: Instant) {
        if let Some(s) = &mut self.slot {
            s.first_token(now);
        }
    }

    /// The response ended at `now` after `output_tokens` (a streamed response's last chunk): a
    /// pick by predicted completion teaches the pool's decode model its steps and the model's
    /// output length. Once.
    pub fn finished(&mut self, now: Instant, output_tokens: u64) {
        if let Some(s) = &mut self.slot {
            s.finished(now, output_tokens);
        }
    }

    /// Moves the booking to another endpoint (the proxy reported it served the request elsewhere).
    /// A slot-tracker booking is released (it was computed for the endpoint the picker chose).
    pub fn move_to(&mut self, other: &Arc<EndpointLoad>) {
        if self.load.as_ref().is_none_or(|l| Arc::ptr_eq(l, other)) {
            return;
        }
        let seen = self.first_byte_seen;
        let mut moved = Booking::new(other, self.hub.clone());
        if seen {
            moved.first_byte();
        }
        // The prefill leg ran (or runs) where it was booked, whoever decodes.
        moved.prefill = self.prefill.take();
        *self = moved;
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        // The slot-tracker entry (and the prefill leg) go first, so a listener woken below sees
        // the load gone everywhere.
        self.slot = None;
        self.prefill = None;
        if let Some(l) = self.load.take() {
            l.finish(self.first_byte_seen);
            if let Some(hub) = &self.hub {
                hub.each(|x| x.released());
            }
        }
    }
}
