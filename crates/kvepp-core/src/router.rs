//! The one entry point of the routing core: a request's facts and the pool's ready endpoints in,
//! a [`Decision`] out, already booked.
//!
//! Every front door (the ext_proc stream, HTTP selection services, replica sync) calls
//! [`Router::route`]; none of them hashes prompts, ranks candidates or books load itself. What a
//! decision holds:
//! - the pick: primary, second-best fallback, and for the KV-aware picker its reasons (overlap per
//!   tier, cost, effective prefill tokens, the load terms);
//! - the booking: the endpoint's in-flight count and, for KV-aware picks, the slot-tracker entry.
//!   Both are released exactly once, when the [`Booking`] is dropped (or moved with
//!   [`Booking::move_to`]).
//!
//! Background upkeep goes through the same object: [`Router::retain`] with the pool's live
//! endpoints whenever it changes (or [`Router::forget`] for one), and [`Router::maintain`] on a
//! timer (stale bookings), whatever the picker, so no mode leaks state.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use crate::disagg::{Pairing, TransferSettings};
use crate::kv::{worker_id, KvPicker, KvState, PrefixMode, PromptBlocks, BOOKING_ATTEMPTS};
use crate::load::Booking;
use crate::pick::{
    Admission, Endpoint, Pick, PickContext, PickError, PickRequest, Picker, Saturation, Selector,
};

/// A request's prompt as the request path found it (not hashed yet: the block size is the
/// router's).
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Prompt<'a> {
    /// No prompt: load-only pick.
    #[default]
    None,
    /// Token ids the client sent (a completions `prompt` of integers).
    TokenIds(Vec<u32>),
    /// Token ids from kvepp's tokenizer.
    Tokens(Vec<u32>),
    /// The prompt's raw bytes (no tokenizer): approximate blocks, kept apart per `scope`.
    Text { scope: &'a str, bytes: &'a [u8] },
}

/// What the router needs to know about one request.
#[derive(Debug, Clone, Default)]
pub struct RequestFacts<'a> {
    /// The model the engine will serve (after any rewrite): a LoRA adapter when it differs from
    /// the engines' base model, which seeds the block hashes.
    pub model: Option<&'a str>,
    /// InferenceObjective priority (higher is more important; negative is sheddable).
    pub priority: i32,
    /// Whether a saturated pool sheds only sheddable requests or refuses every one (to queue it).
    pub admission: Admission,
    /// The proxy's subset hint: when `Some`, only these endpoints may be picked.
    pub subset: Option<&'a [SocketAddr]>,
    pub prompt: Prompt<'a>,
}

/// A routing decision and the load it booked.
#[derive(Debug)]
pub struct Decision {
    pub pick: Pick,
    /// How the prompt's cached prefix was looked up (`None` for load-only pickers or no prompt).
    pub mode: PrefixMode,
    /// Released (in-flight count, slot tracker) when dropped.
    pub booking: Booking,
    /// Picks made again because the chosen endpoint's load changed before the booking.
    pub repicks: u32,
}

/// Eligibility, shedding, picking and booking over one picker.
#[derive(Debug)]
pub struct Router {
    selector: Selector,
    kv: Option<Arc<KvState>>,
    disagg: TransferSettings,
}

impl Router {
    /// The KV-aware picker over `kv` (precise, or approximate when its settings say so).
    pub fn kv_aware(kv: Arc<KvState>, saturation: Saturation) -> Self {
        Router {
            selector: Selector::new(Box::new(KvPicker(kv.clone())), saturation),
            kv: Some(kv),
            disagg: TransferSettings::default(),
        }
    }

    /// A load-only picker (least loaded, round robin): no prompt hashing, no slot tracking.
    pub fn load_only(picker: Box<dyn Picker>, saturation: Saturation) -> Self {
        Router {
            selector: Selector::new(picker, saturation),
            kv: None,
            disagg: TransferSettings::default(),
        }
    }

    /// How disaggregated pools pair prefill and decode workers (topology level, mismatch
    /// policy, transfer cost).
    pub fn with_disaggregation(mut self, settings: TransferSettings) -> Self {
        self.disagg = settings;
        self
    }

    pub fn disaggregation(&self) -> &TransferSettings {
        &self.disagg
    }

    /// The KV-aware state, when the picker is KV-aware (event ingestion feeds its index).
    pub fn kv(&self) -> Option<&Arc<KvState>> {
        self.kv.as_ref()
    }

    /// Whether the prompt matters to this router (callers skip tokenizing when it does not).
    pub fn wants_prompt(&self) -> bool {
        self.kv.is_some()
    }

    /// Hashes the prompt, picks among `endpoints` and books the primary. In a disaggregated pool
    /// (some endpoint only prefills or only decodes) the primary is the decode worker and the
    /// pick's [`Pick::pairing`] names the prefill worker; both are booked.
    ///
    /// The facts are consumed: a prompt's token ids end in the memo of recent prompts, not copied.
    pub fn route(
        &self,
        mut facts: RequestFacts<'_>,
        endpoints: &[Arc<Endpoint>],
        ctx: &mut PickContext,
    ) -> Result<Decision, PickError> {
        let prompt = std::mem::take(&mut facts.prompt);
        let prompt = self
            .kv
            .as_ref()
            .and_then(|kv| prompt_blocks(kv, facts.model, prompt));
        if TransferSettings::is_disaggregated(endpoints) {
            return self.route_disaggregated(&facts, endpoints, prompt.as_ref(), ctx);
        }
        self.route_among(&facts, endpoints, prompt.as_ref(), ctx)
    }

    /// One pick among `endpoints`, booked with its full prefill. A KV-aware pick books exactly
    /// the load it read: if the chosen endpoint's load changed in between (a concurrent pick
    /// booked it, or a request there ended), it picks again, at most [`BOOKING_ATTEMPTS`] times,
    /// the last one booked whatever changed.
    fn route_among(
        &self,
        facts: &RequestFacts<'_>,
        endpoints: &[Arc<Endpoint>],
        prompt: Option<&PromptBlocks>,
        ctx: &mut PickContext,
    ) -> Result<Decision, PickError> {
        // A decode pick's transfer costs: the pick consumes them, a second try needs them again.
        let bias = (!ctx.bias.is_empty()).then(|| ctx.bias.clone());
        let mut attempt = 1;
        loop {
            let pick = self.selector.pick(
                endpoints,
                &PickRequest {
                    priority: facts.priority,
                    admission: facts.admission,
                    subset: facts.subset,
                    prompt,
                },
                ctx,
            )?;
            let booking = match (&self.kv, &pick.kv) {
                (Some(kv), Some(d)) if attempt < BOOKING_ATTEMPTS => kv
                    .book_decision(&pick.primary, prompt, d, ctx.now)
                    .map(|slot| pick.primary.load.book().with_slot(slot)),
                _ => Some(self.book(
                    &pick.primary,
                    prompt,
                    pick.kv.map(|d| d.effective_prefill_tokens),
                    ctx,
                )),
            };
            if let Some(booking) = booking {
                return Ok(Decision {
                    mode: pick.kv.map_or(PrefixMode::None, |d| d.mode),
                    pick,
                    booking,
                    repicks: attempt as u32 - 1,
                });
            }
            attempt += 1;
            if let Some(b) = &bias {
                ctx.bias.clone_from(b);
            }
        }
    }

    /// Books `ep`: its in-flight count and, for a KV-aware pick (`effective` prefill tokens
    /// known), the slot tracker.
    fn book(
        &self,
        ep: &Arc<Endpoint>,
        prompt: Option<&PromptBlocks>,
        effective: Option<u64>,
        ctx: &PickContext,
    ) -> Booking {
        let booking = ep.load.book();
        match (&self.kv, effective) {
            (Some(kv), Some(tokens)) => booking.with_slot(kv.book(ep, prompt, tokens, ctx.now)),
            _ => booking,
        }
    }

    /// A disaggregated pick: the prefill worker by the KV-aware cost (among those with a decode
    /// worker in their domain first), then the decode worker under the topology constraint with
    /// the transfer cost added. Short prompts (or a pool without prefill workers) go to a decode
    /// worker alone, which prefills them itself.
    fn route_disaggregated(
        &self,
        facts: &RequestFacts<'_>,
        endpoints: &[Arc<Endpoint>],
        prompt: Option<&PromptBlocks>,
        ctx: &mut PickContext,
    ) -> Result<Decision, PickError> {
        let decode: Vec<Arc<Endpoint>> = endpoints
            .iter()
            .filter(|e| e.role.decodes())
            .cloned()
            .collect();
        if decode.is_empty() {
            return Err(PickError::NoDecodeEndpoints);
        }
        let isl = prompt.map_or(0, |p| p.isl_tokens);
        let prefill: Vec<Arc<Endpoint>> = endpoints
            .iter()
            .filter(|e| e.role.prefills())
            .cloned()
            .collect();
        if prefill.is_empty() || prompt.is_none() || isl < self.disagg.prefill_threshold_tokens {
            return self.route_among(facts, &decode, prompt, ctx);
        }
        let prefill = self.disagg.prefill_candidates(prefill, &decode);
        // The subset hint names where the proxy may send the request: the decode worker. Scores,
        // when asked for, are the decode candidates'.
        let scores = ctx.scores.take();
        let p = self.selector.pick(
            &prefill,
            &PickRequest {
                priority: facts.priority,
                admission: facts.admission,
                subset: None,
                prompt,
            },
            ctx,
        );
        ctx.scores = scores;
        let p = p?;
        let cands = self.disagg.decode_candidates(&p.primary, &decode, isl)?;
        ctx.bias = cands.bias;
        // Decode cost: the decode worker's active load (and the transfer), not the prompt's
        // prefill, which the prefill worker does.
        let mut pick = self.selector.pick(
            &cands.endpoints,
            &PickRequest {
                priority: facts.priority,
                admission: facts.admission,
                subset: facts.subset,
                prompt: None,
            },
            ctx,
        )?;
        let prefill_kv = p.kv;
        let mode = prefill_kv.map_or(PrefixMode::None, |d| d.mode);
        if pick.primary.addr == p.primary.addr {
            // One worker does both: no transfer, an ordinary booking.
            pick.kv = prefill_kv;
            let booking = self.book(
                &pick.primary,
                prompt,
                prefill_kv.map(|d| d.effective_prefill_tokens),
                ctx,
            );
            return Ok(Decision {
                pick,
                mode,
                booking,
                repicks: 0,
            });
        }
        let prefill_booking = self.book(
            &p.primary,
            prompt,
            prefill_kv.map(|d| d.effective_prefill_tokens),
            ctx,
        );
        let booking = self
            .book(&pick.primary, prompt, prefill_kv.map(|_| 0), ctx)
            .with_prefill(prefill_booking);
        let level = self.disagg.kv_transfer_topology_level.as_deref();
        let domain = |e: &Endpoint| level.and_then(|l| e.domain(l)).map(str::to_owned);
        let bytes = isl as f64 * self.disagg.kv_bytes_per_token as f64;
        pick.pairing = Some(Pairing {
            prefill_domain: domain(&p.primary),
            decode_domain: domain(&pick.primary),
            crossed: cands.crossed,
            transfer_ms: self.disagg.transfer_ms(&p.primary, &pick.primary, bytes),
            prefill: p.primary,
        });
        pick.kv = prefill_kv;
        Ok(Decision {
            pick,
            mode,
            booking,
            repicks: 0,
        })
    }

    /// An endpoint left the pool: its cached blocks (precise and approximate) and load go.
    pub fn forget(&self, addr: &str) {
        if let Some(kv) = &self.kv {
            kv.forget(addr);
        }
    }

    /// Keeps only the endpoints at `live` (their `ip:port`): every other endpoint's cached
    /// prefixes and load are forgotten. Returns how many endpoints were forgotten.
    pub fn retain<'a>(&self, live: impl IntoIterator<Item = &'a str>) -> usize {
        let Some(kv) = &self.kv else { return 0 };
        let live: std::collections::HashSet<u64> = live.into_iter().map(worker_id).collect();
        kv.retain_workers(|w| live.contains(&w))
    }

    /// Whether any of `endpoints` can take a request now without being over its saturation
    /// limits (flow control dispatches queued requests only then).
    pub fn has_capacity(&self, endpoints: &[Arc<Endpoint>], now: Instant) -> bool {
        // In a disaggregated pool the destination is a decode worker: capacity is a decode
        // worker's.
        let disaggregated = TransferSettings::is_disaggregated(endpoints);
        self.selector.has_capacity(
            endpoints
                .iter()
                .filter(|e| !disaggregated || e.role.decodes()),
            now,
        )
    }

    /// Periodic upkeep at `now`: drops bookings whose end was never seen. Returns how many.
    pub fn maintain(&self, now: Instant) -> usize {
        self.kv.as_ref().map_or(0, |kv| kv.expire_stale(now))
    }
}

/// The prompt as KV blocks in the router's block size: token ids seeded by the LoRA adapter (when
/// `model` is one), or approximate blocks of the raw bytes.
fn prompt_blocks(kv: &KvState, model: Option<&str>, prompt: Prompt<'_>) -> Option<PromptBlocks> {
    let lora = || model.and_then(|m| kv.lora_for(m));
    match prompt {
        Prompt::None => None,
        Prompt::TokenIds(ids) => {
            Some(kv.blocks_from_owned_tokens(ids, lora().as_deref(), PrefixMode::TokenIds))
        }
        Prompt::Tokens(ids) => {
            Some(kv.blocks_from_owned_tokens(ids, lora().as_deref(), PrefixMode::Tokens))
        }
        Prompt::Text { scope, bytes } => Some(kv.blocks_from_text(scope, bytes)),
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod pd_tests;

#[cfg(test)]
mod ttft_tests;
