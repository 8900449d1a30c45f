//! The catalog's reservations: what it holds for each id, and their lifecycle (prefill complete,
//! output blocks, free, expiry).
//!
//! Invariants: an id is held at most once per key (a global id, or a (model, tenant)-scoped one);
//! a reservation this process decided holds its [`Booking`], which is the only way its load is
//! released (dropping it frees the slot-tracker entry and tells the scope's listeners); a peer's
//! reservation holds nothing and is freed by id. What a client does to a reservation is told to
//! the listeners whoever decided it; what a peer tells is applied silently.

use super::*;

/// Who asks for a lifecycle step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// A client of this process's HTTP doors: the step is told to the listeners.
    Client,
    /// A peer replica (replica sync): applied here only.
    Peer,
}

/// A reservation's id, global or scoped by (model, tenant).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Key {
    pub(super) scope: Option<Scope>,
    pub(super) id: String,
}

impl Key {
    pub(super) fn global(id: &str) -> Self {
        Key {
            scope: None,
            id: id.to_owned(),
        }
    }

    pub(super) fn scoped(scope: &Scope, id: &str) -> Self {
        Key {
            scope: Some(scope.clone()),
            id: id.to_owned(),
        }
    }
}

#[derive(Debug)]
pub(super) enum Holder {
    /// Decided here: the booking.
    Local(Booking),
    /// A peer's, recorded by id.
    Peer,
}

#[derive(Debug)]
pub(super) struct HeldBooking {
    pub(super) scope: Scope,
    pub(super) holder: Holder,
}

impl HeldBooking {
    pub(super) fn local(scope: &Scope, booking: Booking) -> Self {
        HeldBooking {
            scope: scope.clone(),
            holder: Holder::Local(booking),
        }
    }

    pub(super) fn peer(scope: &Scope) -> Self {
        HeldBooking {
            scope: scope.clone(),
            holder: Holder::Peer,
        }
    }
}

/// The answer of a rank-level decision.
pub(super) fn choice_of(d: &Decision, isl_tokens: u64) -> RankChoice {
    let kv = d.pick.kv.unwrap_or(crate::kv::KvDecision {
        mode: crate::kv::PrefixMode::None,
        prompt_blocks: 0,
        overlap: Overlap::default(),
        cost: 0.0,
        effective_prefill_tokens: isl_tokens,
        potential_prefill_tokens: 0,
        potential_decode_blocks: 0,
        active_requests: 0,
        load_version: None,
        load_bounded: false,
        objective_filtered: false,
        ttft: None,
        decode: None,
        objective: None,
    });
    RankChoice {
        rank: d.pick.primary.rank(),
        overlap: kv.overlap,
        cost: kv.cost,
        effective_prefill_tokens: kv.effective_prefill_tokens,
        load: CandidateLoad {
            overlap: kv.overlap,
            potential_prefill_tokens: kv.potential_prefill_tokens,
            potential_decode_blocks: kv.potential_decode_blocks,
            active_requests: kv.active_requests,
        },
    }
}

/// A refusal of the transaction as the catalog reports it.
pub(super) fn pick_error(scope: &Scope, e: PickError) -> CatalogError {
    match e {
        PickError::NoReadyEndpoints => CatalogError::UnknownScope {
            model: scope.model.clone(),
            tenant: scope.tenant.clone(),
        },
        PickError::DuplicateBooking(id) => CatalogError::DuplicateReservation(id),
        other => CatalogError::Refused(other.to_string()),
    }
}

impl Catalog {
    /// The tracker of the reservation under `key`, when it is held and still active (forgetting
    /// it when it is no longer active).
    fn held<T>(
        &self,
        key: &Key,
        f: impl FnOnce(&Tracker, &mut HeldBooking) -> Result<T, CatalogError>,
    ) -> Result<T, CatalogError> {
        let mut map = self.reservations.lock();
        let unknown = || CatalogError::UnknownReservation(key.id.clone());
        let held = map.get_mut(key).ok_or_else(unknown)?;
        match self.tracker(&held.scope) {
            Ok(t) if t.kv.is_active(&key.id) => f(t, held),
            _ => {
                map.remove(key);
                Err(unknown())
            }
        }
    }

    fn prefill_complete_key(&self, key: &Key, by: Origin) -> Result<(), CatalogError> {
        self.held(key, |t, held| match (&mut held.holder, by) {
            (Holder::Local(b), Origin::Client) => {
                b.first_byte();
                Ok(())
            }
            (_, by) => {
                t.kv.prefill_complete(&key.id)?;
                if by == Origin::Client {
                    t.kv.hub().each(|l| l.prefill_complete(&key.id));
                }
                Ok(())
            }
        })
    }

    /// Frees the reservation under `key`; whether it was active.
    fn free_key(&self, key: &Key, by: Origin) -> bool {
        let Some(held) = self.reservations.lock().remove(key) else {
            return false;
        };
        let Ok(t) = self.tracker(&held.scope) else {
            return false;
        };
        let active = t.kv.is_active(&key.id);
        match held.holder {
            // Tells the listeners (when it was active) as it drops.
            Holder::Local(b) if by == Origin::Client => drop(b),
            holder => {
                t.kv.free(&key.id);
                if active && by == Origin::Client {
                    t.kv.hub().each(|l| l.freed(&key.id));
                }
                // A local booking freed by a peer: its load goes, its free is not told again.
                drop(holder);
            }
        }
        active
    }

    /// Prefill of a (global-id) reservation is over.
    pub fn prefill_complete(&self, id: &str) -> Result<(), CatalogError> {
        self.prefill_complete_key(&Key::global(id), Origin::Client)
    }

    /// [`Self::prefill_complete`], asked by `by`, of a global or (model, tenant)-scoped id.
    pub fn prefill_complete_by(
        &self,
        scope: Option<&Scope>,
        id: &str,
        by: Origin,
    ) -> Result<(), CatalogError> {
        let key = match scope {
            Some(s) => Key::scoped(s, id),
            None => Key::global(id),
        };
        self.prefill_complete_key(&key, by)
    }

    pub fn output_block(&self, id: &str, decay_fraction: Option<f64>) -> Result<(), CatalogError> {
        self.held(&Key::global(id), |t, held| match &held.holder {
            Holder::Local(b) => Ok(b.output_block(decay_fraction)?),
            Holder::Peer => Ok(t.kv.output_block(id, decay_fraction)?),
        })
    }

    /// Frees a (global-id) reservation; whether it was active.
    pub fn free(&self, id: &str) -> bool {
        self.free_key(&Key::global(id), Origin::Client)
    }

    /// [`Self::free`], asked by `by`, of a global or (model, tenant)-scoped id.
    pub fn free_by(&self, scope: Option<&Scope>, id: &str, by: Origin) -> bool {
        let key = match scope {
            Some(s) => Key::scoped(s, id),
            None => Key::global(id),
        };
        self.free_key(&key, by)
    }

    /// Drops stale requests in every scope and the reservations no longer active, whoever
    /// expired them (this call, or the router's upkeep over a shared state): their bookings
    /// release their load; an expired entry is not told as freed. Returns the stale requests this
    /// call dropped.
    pub fn expire(&self, now: Instant) -> usize {
        let pool_scope = Scope {
            model: String::new(),
            tenant: String::new(),
        };
        let expired = self
            .trackers(&pool_scope)
            .map(|(_, t)| t.kv.expire_stale(now))
            .sum();
        {
            let gone: Vec<HeldBooking> = {
                let mut map = self.reservations.lock();
                let dead: Vec<Key> = map
                    .iter()
                    .filter(|(k, h)| !self.tracker(&h.scope).is_ok_and(|t| t.kv.is_active(&k.id)))
                    .map(|(k, _)| k.clone())
                    .collect();
                dead.iter().filter_map(|k| map.remove(k)).collect()
            };
            drop(gone);
        }
        expired
    }

    pub fn reservation_count(&self) -> usize {
        self.reservations.lock().len()
    }
}
