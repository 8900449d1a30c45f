//! The one transaction of the routing core: a request's facts and its candidates in, a
//! [`Decision`] out, already booked.
//!
//! Every front door calls [`Router::route`] (or [`Router::preview`], which decides without
//! booking): the ext_proc stream with the pool's endpoints, the HTTP selection services with their
//! registered ranks (or, in `kvepp serve`, the same pool endpoints), for a reservation on a given
//! rank with that one rank. None of them hashes prompts, ranks candidates, books load or retries.
//! The pipeline, in order: the prompt as blocks → candidates (a disaggregated pool's prefill and
//! decode workers) → filters (subset hint, saturation and admission) → one cost (the picker's:
//! Dynamo's terms with the bias and bounded loads, or predicted TTFT) → choice (temperature,
//! tie-break) → booking. A KV-aware booking books exactly the load its pick read: if the chosen
//! rank's load changed in between, the pipeline runs again, at most [`BOOKING_ATTEMPTS`] times,
//! the last one booking whatever changed. The [`Booking`] it returns is the only way the load is
//! released; its drop (and its first byte) tells the router's [`Hub`]: flow control, replica
//! sync, metrics.
//!
//! Background upkeep goes through the same object: [`Router::retain`] with the pool's live
//! endpoints whenever it changes (or [`Router::forget`] for one), and [`Router::maintain`] on a
//! timer (stale bookings), whatever the picker, so no mode leaks state.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::affinity::{AdapterAffinity, SessionAffinity, SessionKey, SessionOutcome, Sessions};
use crate::booking::Booking;
use crate::cost::CostWeights;
use crate::disagg::{Pairing, TransferSettings};
use crate::hash::SequenceHash;
use crate::kv::{worker_id, KvPicker, KvState, PrefixMode, PromptBlocks, SlotBooking};
use crate::listen::{Hub, Listener};
use crate::pick::{
    Admission, Endpoint, Pick, PickContext, PickError, PickRequest, Picker, Saturation, Selector,
    Tuning,
};
use crate::types::{clock_nanos, WorkerRank};

/// Runs of the pipeline for one decision whose booking found the chosen rank's load changed since
/// its pick read it: the last one books whatever changed.
pub const BOOKING_ATTEMPTS: u32 = 4;

/// A request's prompt as the request path found it (not hashed yet: the block size is the
/// router's).
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Prompt<'a> {
    /// No prompt: load-only pick.
    #[default]
    None,
    /// Token ids the client sent (a completions `prompt` of integers).
    TokenIds(Vec<u32>),
    /// The same, as the pieces the request path found them in, in order (chunks of the body's
    /// array, shared with its chunk cache: hashed without a flat copy, and compared with a
    /// recent prompt's pieces by address).
    TokenIdPieces(Vec<Arc<[u32]>>),
    /// Token ids from kvepp's tokenizer.
    Tokens(Vec<u32>),
    /// Token ids from kvepp's tokenizer, as the pieces they were assembled from in order (a
    /// chat's segments, shared with the tokenizer's segment cache: hashed without a flat copy).
    Pieces(Vec<Arc<[u32]>>),
    /// The prompt's raw bytes (no tokenizer): approximate blocks, kept apart per `scope`.
    Text { scope: &'a str, bytes: &'a [u8] },
    /// The prompt already as blocks ([`Router::blocks`]): a request decided more than once (flow
    /// control's turns) is hashed once.
    Blocks(&'a PromptBlocks),
    /// The prompt's chained block hashes, computed by the client in the router's block size (the
    /// HTTP selection services), and its length in tokens.
    Hashes {
        hashes: Vec<SequenceHash>,
        isl_tokens: u64,
    },
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
    /// The booking's slot-tracker id: a client's reservation id (the HTTP services); None: a
    /// process-local id. An id already active is refused ([`PickError::DuplicateBooking`]).
    pub booking_id: Option<&'a str>,
    /// Prefill tokens to book instead of what the cost computed (a client's own figure for a
    /// reservation on a given rank).
    pub prefill_tokens: Option<u64>,
    /// The client's session: the request goes to the rank it is bound to while that rank is a
    /// candidate and not saturated, and the binding follows the pick.
    pub session: Option<SessionKey>,
    /// What is left of the request's TTFT objective, in ms ([`PickRequest::ttft_budget_ms`]).
    pub ttft_budget_ms: Option<f64>,
    /// The request's time-per-output-token objective, in ms ([`PickRequest::tpot_budget_ms`]).
    pub tpot_budget_ms: Option<f64>,
    /// The request's `max_tokens` (`max_completion_tokens`, `max_output_tokens`).
    pub max_tokens: Option<u64>,
    /// The endpoint list's identity ([`PickRequest::list`]): a pool snapshot's serial number.
    pub list: Option<u64>,
}

impl RequestFacts<'_> {
    /// The same facts for another endpoint list than the one `list` names (the decode workers
    /// of a disaggregated pool).
    fn unnamed(&self) -> Self {
        RequestFacts {
            list: None,
            ..self.clone()
        }
    }
}

/// A routing decision and the load it booked.
#[derive(Debug)]
pub struct Decision {
    pub pick: Pick,
    /// How the prompt's cached prefix was looked up (`None` for load-only pickers or no prompt).
    pub mode: PrefixMode,
    /// Released (in-flight count, slot tracker) when dropped; holds nothing for a preview.
    pub booking: Booking,
    /// Picks made again because the chosen endpoint's load changed before the booking.
    pub repicks: u32,
    /// What the decision did to the request's session binding (None: no session).
    pub session: Option<SessionOutcome>,
}

/// Eligibility, shedding, picking and booking over one picker.
#[derive(Debug)]
pub struct Router {
    selector: Selector,
    kv: Option<Arc<KvState>>,
    disagg: TransferSettings,
    /// Who hears of this router's bookings (the KV-aware state's hub, when there is one).
    hub: Arc<Hub>,
    /// Session bindings (shared with peer replicas through the hub's listeners).
    sessions: Arc<Sessions>,
}

impl Router {
    /// The KV-aware picker over `kv` (precise, or approximate when its settings say so).
    pub fn kv_aware(kv: Arc<KvState>, saturation: Saturation) -> Self {
        Router {
            selector: Selector::new(Box::new(KvPicker(kv.clone())), saturation),
            hub: kv.hub().clone(),
            kv: Some(kv),
            disagg: TransferSettings::default(),
            sessions: Arc::default(),
        }
    }

    /// A load-only picker (least loaded, round robin): no prompt hashing, no slot tracking.
    pub fn load_only(picker: Box<dyn Picker>, saturation: Saturation) -> Self {
        Router {
            selector: Selector::new(picker, saturation),
            kv: None,
            disagg: TransferSettings::default(),
            hub: Arc::default(),
            sessions: Arc::default(),
        }
    }

    /// Whether and how much a request's LoRA adapter weighs in the choice.
    pub fn with_adapter_affinity(mut self, adapters: AdapterAffinity) -> Self {
        self.selector = self.selector.with_adapter_affinity(adapters);
        self
    }

    /// The table that keeps session bindings (its time to live and size).
    pub fn with_sessions(mut self, sessions: Sessions) -> Self {
        self.sessions = Arc::new(sessions);
        self
    }

    /// The session bindings (their counters; recovery dumps).
    pub fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    /// A peer replica bound `key` to `rank`, last used `age` before `now`: applied here, not
    /// told to the listeners again.
    pub fn bind_peer_session(
        &self,
        key: SessionKey,
        rank: WorkerRank,
        now: Instant,
        age: Duration,
    ) {
        let age = i64::try_from(age.as_nanos()).unwrap_or(i64::MAX);
        let used = clock_nanos(now).saturating_sub(age);
        self.sessions.bind(key, rank, used);
    }

    /// How disaggregated pools pair prefill and decode workers (topology level, mismatch
    /// policy, transfer cost).
    pub fn with_disaggregation(mut self, settings: TransferSettings) -> Self {
        self.disagg = settings;
        self
    }

    /// Live reconfiguration: the cost weights (KV-aware routers; cost model, bounded loads,
    /// temperature), saturation limits and adapter weights, and the session table's time to live
    /// and bound apply to decisions that start afterwards; bookings made stay as they are.
    pub fn retune(&self, weights: CostWeights, tuning: Tuning, sessions: &SessionAffinity) {
        if let Some(kv) = &self.kv {
            kv.set_weights(weights);
        }
        self.selector.retune(tuning);
        self.sessions.set_limits(
            Duration::from_secs(sessions.ttl_seconds),
            sessions.max_sessions,
        );
    }

    /// The cost model decisions use now (None: a load-only picker).
    pub fn cost_model(&self) -> Option<crate::cost::CostModel> {
        self.kv.as_ref().map(|kv| kv.weights().cost_model)
    }

    /// The saturation limits and adapter weights decisions use now.
    pub fn tuning(&self) -> Tuning {
        self.selector.tuning()
    }

    pub fn disaggregation(&self) -> &TransferSettings {
        &self.disagg
    }

    /// Adds a listener to every booking this router makes from now on (flow control, replica
    /// sync, metrics).
    pub fn listen(&self, l: Arc<dyn Listener>) {
        self.hub.listen(l);
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
        facts: RequestFacts<'_>,
        endpoints: &[Arc<Endpoint>],
        ctx: &mut PickContext,
    ) -> Result<Decision, PickError> {
        self.decide(facts, endpoints, ctx, true)
    }

    /// [`Self::route`] without the booking: the decision as it would be now (the selection
    /// service's `/select`). Its booking holds nothing.
    pub fn preview(
        &self,
        facts: RequestFacts<'_>,
        endpoints: &[Arc<Endpoint>],
        ctx: &mut PickContext,
    ) -> Result<Decision, PickError> {
        self.decide(facts, endpoints, ctx, false)
    }

    fn decide(
        &self,
        mut facts: RequestFacts<'_>,
        endpoints: &[Arc<Endpoint>],
        ctx: &mut PickContext,
        book: bool,
    ) -> Result<Decision, PickError> {
        let owned;
        let prompt = match std::mem::take(&mut facts.prompt) {
            Prompt::Blocks(b) => Some(b),
            other => {
                owned = self.blocks(facts.model, other);
                owned.as_ref()
            }
        };
        if TransferSettings::is_disaggregated(endpoints) {
            return self.route_disaggregated(&facts, endpoints, prompt, ctx, book);
        }
        self.route_among(&facts, endpoints, prompt, &[], ctx, book)
    }

    /// The prompt as blocks in this router's block size (token ids seeded by the LoRA adapter
    /// when `model` is one, or approximate blocks of the raw bytes); None for a load-only router
    /// or no prompt. Consumes the prompt: token ids end in the memo of recent prompts.
    pub fn blocks(&self, model: Option<&str>, prompt: Prompt<'_>) -> Option<PromptBlocks> {
        self.kv
            .as_ref()
            .and_then(|kv| prompt_blocks(kv, model, prompt))
    }

    /// One pick among `endpoints` (with `bias`, a decode pick's transfer costs, in their order),
    /// booked with its full prefill unless `book` is false. The only retry loop of the core: a
    /// KV-aware pick books exactly the load it read, or picks again (see [`BOOKING_ATTEMPTS`]).
    fn route_among(
        &self,
        facts: &RequestFacts<'_>,
        endpoints: &[Arc<Endpoint>],
        prompt: Option<&PromptBlocks>,
        bias: &[f64],
        ctx: &mut PickContext,
        book: bool,
    ) -> Result<Decision, PickError> {
        let bound = self.bound(facts, ctx.now);
        let req = PickRequest {
            priority: facts.priority,
            admission: facts.admission,
            subset: facts.subset,
            prompt,
            bias,
            adapter: self.adapter_of(facts.model),
            sticky: bound,
            ttft_budget_ms: facts.ttft_budget_ms,
            tpot_budget_ms: facts.tpot_budget_ms,
            model: facts.model,
            max_tokens: facts.max_tokens,
            list: facts.list,
        };
        let mut repicks = 0;
        loop {
            let pick = self.selector.pick(endpoints, &req, ctx)?;
            let mode = pick.kv.map_or(PrefixMode::None, |d| d.mode);
            if !book {
                let booking = Booking::none();
                let session = self.settle_session(facts.session, bound, &pick.primary, ctx, false);
                return Ok(Decision {
                    pick,
                    mode,
                    booking,
                    repicks,
                    session,
                });
            }
            let checked = repicks + 1 < BOOKING_ATTEMPTS;
            let slot = pick.kv.as_ref().map(|d| SlotBooking {
                id: facts.booking_id,
                prefill_tokens: facts.prefill_tokens.unwrap_or(d.effective_prefill_tokens),
                held: d.overlap.device,
                expected: checked.then(|| d.load_version.unwrap_or(0)),
                learn: d.ttft,
                decode: d.decode,
                model: facts.model,
                now: ctx.now,
            });
            if let Some(booking) = self.book(&pick.primary, prompt, slot)? {
                note_adapter(&pick.primary, req.adapter);
                let session = self.settle_session(facts.session, bound, &pick.primary, ctx, true);
                return Ok(Decision {
                    pick,
                    mode,
                    booking,
                    repicks,
                    session,
                });
            }
            repicks += 1;
        }
    }

    /// The adapter a request for `model` runs with (None: the base model, or no base model
    /// known, or a load-only router).
    fn adapter_of<'a>(&self, model: Option<&'a str>) -> Option<&'a str> {
        let kv = self.kv.as_ref()?;
        model.filter(|m| kv.is_adapter(m))
    }

    /// The rank the request's session is bound to now.
    fn bound(&self, facts: &RequestFacts<'_>, now: Instant) -> Option<WorkerRank> {
        let key = facts.session?;
        self.sessions.get(key, clock_nanos(now))
    }

    /// What the decision did to the session's binding; when booked, the binding follows the
    /// primary (refreshed on a hit) and the listeners hear of it.
    fn settle_session(
        &self,
        key: Option<SessionKey>,
        bound: Option<WorkerRank>,
        primary: &Endpoint,
        ctx: &PickContext,
        book: bool,
    ) -> Option<SessionOutcome> {
        let key = key?;
        let rank = primary.rank();
        let outcome = match bound {
            None => SessionOutcome::New,
            Some(b) if b == rank => SessionOutcome::Hit,
            Some(_) => SessionOutcome::Moved,
        };
        if book {
            self.sessions.bind(key, rank, clock_nanos(ctx.now));
            self.hub.each(|l| l.session_bound(key, rank));
        }
        Some(outcome)
    }

    /// Books `ep`: its in-flight count and, for a KV-aware pick (`slot`), the slot tracker.
    /// `Ok(None)`: the slot's expected load version changed; nothing was booked.
    fn book(
        &self,
        ep: &Arc<Endpoint>,
        prompt: Option<&PromptBlocks>,
        slot: Option<SlotBooking<'_>>,
    ) -> Result<Option<Booking>, PickError> {
        let guard = match (&self.kv, slot) {
            (Some(kv), Some(slot)) => match kv.book(ep, prompt, slot) {
                Ok(Some(g)) => Some(g),
                Ok(None) => return Ok(None),
                Err(crate::slots::SlotError::DuplicateRequest(id)) => {
                    return Err(PickError::DuplicateBooking(id))
                }
                // Registered as it books: cannot happen; the load alone is booked.
                Err(_) => None,
            },
            _ => None,
        };
        let booking = Booking::new(&ep.load, Some(self.hub.clone()));
        Ok(Some(match guard {
            Some(g) => booking.with_slot(g),
            None => booking,
        }))
    }

    /// A disaggregated pick: the prefill worker by the KV-aware cost (among those with a decode
    /// worker in their domain first), then the decode worker under the topology constraint with
    /// the transfer cost added. Prompts whose uncached part on the best decode worker is short
    /// ([`Self::worth_prefill`]), or a pool without prefill workers, go to a decode worker alone,
    /// which prefills them itself.
    fn route_disaggregated(
        &self,
        facts: &RequestFacts<'_>,
        endpoints: &[Arc<Endpoint>],
        prompt: Option<&PromptBlocks>,
        ctx: &mut PickContext,
        book: bool,
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
        if prefill.is_empty() || !self.worth_prefill(facts, &decode, prompt, ctx) {
            return self.route_among(&facts.unnamed(), &decode, prompt, &[], ctx, book);
        }
        let prefill = self.disagg.prefill_candidates(prefill, &decode);
        // Both legs need the adapter; the session binds the decode worker (where the proxy sends
        // the request).
        let adapter = self.adapter_of(facts.model);
        let bound = self.bound(facts, ctx.now);
        // The subset hint names where the proxy may send the request: the decode worker. Scores,
        // when asked for, are the decode candidates'.
        let scores = ctx.scores.take();
        let leg = PickRequest {
            priority: facts.priority,
            admission: facts.admission,
            adapter,
            ..PickRequest::default()
        };
        // The prefill leg decides when the first token can come: the TTFT budget is its.
        let p = self.selector.pick(
            &prefill,
            &PickRequest {
                prompt,
                ttft_budget_ms: facts.ttft_budget_ms,
                ..leg
            },
            ctx,
        );
        ctx.scores = scores;
        let p = p?;
        let cands = self.disagg.decode_candidates(&p.primary, &decode, isl)?;
        // Decode cost: the decode worker's active load (and the transfer), not the prompt's
        // prefill, which the prefill worker does.
        let mut pick = self.selector.pick(
            &cands.endpoints,
            &PickRequest {
                subset: facts.subset,
                bias: &cands.bias,
                sticky: bound,
                ..leg
            },
            ctx,
        )?;
        let prefill_kv = p.kv;
        let mode = prefill_kv.map_or(PrefixMode::None, |d| d.mode);
        // Both legs are booked as picked (no second run: the pair was chosen together).
        let leg = |id, tokens: u64| SlotBooking {
            id,
            prefill_tokens: tokens,
            held: 0,
            expected: None,
            learn: None,
            decode: None,
            model: None,
            now: ctx.now,
        };
        let one_worker = pick.primary.addr == p.primary.addr;
        let booking = if !book {
            Booking::none()
        } else if one_worker {
            // One worker does both: no transfer, an ordinary booking.
            let slot = prefill_kv.as_ref().map(|d| {
                let tokens = facts.prefill_tokens.unwrap_or(d.effective_prefill_tokens);
                leg(facts.booking_id, tokens)
            });
            self.booked(&pick.primary, prompt, slot)?
        } else {
            let slot = prefill_kv
                .as_ref()
                .map(|d| leg(None, d.effective_prefill_tokens));
            let prefill_booking = self.booked(&p.primary, prompt, slot)?;
            let slot = prefill_kv.as_ref().map(|_| leg(facts.booking_id, 0));
            self.booked(&pick.primary, prompt, slot)?
                .with_prefill(prefill_booking)
        };
        if book {
            note_adapter(&p.primary, adapter);
            note_adapter(&pick.primary, adapter);
        }
        if !one_worker {
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
        }
        pick.kv = prefill_kv;
        let session = self.settle_session(facts.session, bound, &pick.primary, ctx, book);
        Ok(Decision {
            pick,
            mode,
            booking,
            repicks: 0,
            session,
        })
    }

    /// Whether a disaggregated pool's request goes through a prefill worker: only when the part
    /// of its prompt the best decode candidate has not cached (a preview of the decode-only pick)
    /// exceeds `prefill_threshold_tokens`. A prompt no longer than the threshold needs no preview;
    /// a preview that fails (the decode workers saturated) leaves the prompt's length to decide.
    fn worth_prefill(
        &self,
        facts: &RequestFacts<'_>,
        decode: &[Arc<Endpoint>],
        prompt: Option<&PromptBlocks>,
        ctx: &mut PickContext,
    ) -> bool {
        let Some(isl) = prompt.map(|p| p.isl_tokens) else {
            return false;
        };
        let threshold = self.disagg.prefill_threshold_tokens;
        if isl <= threshold {
            return false;
        }
        let scores = ctx.scores.take();
        let preview = self.route_among(&facts.unnamed(), decode, prompt, &[], ctx, false);
        ctx.scores = scores;
        let uncached = preview
            .ok()
            .and_then(|d| d.pick.kv)
            .map_or(isl, |kv| kv.effective_prefill_tokens);
        uncached > threshold
    }

    /// [`Self::book`] of an unchecked slot, which always books.
    fn booked(
        &self,
        ep: &Arc<Endpoint>,
        prompt: Option<&PromptBlocks>,
        slot: Option<SlotBooking<'_>>,
    ) -> Result<Booking, PickError> {
        Ok(self
            .book(ep, prompt, slot)?
            .unwrap_or_else(|| Booking::new(&ep.load, Some(self.hub.clone()))))
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

/// A request for `adapter` was booked on `ep`: its slots hold the adapter now (remembered among
/// the last `max_lora` it was sent, when it reports its slots).
fn note_adapter(ep: &Endpoint, adapter: Option<&str>) {
    let Some(adapter) = adapter else { return };
    let slots = ep.load.adapters();
    if let Some(cap) = slots.map(|s| s.max_lora as usize).filter(|&c| c > 0) {
        ep.load.recent_adapters.note(adapter, cap);
    }
}

/// The prompt as KV blocks in the router's block size: token ids seeded by the LoRA adapter (when
/// `model` is one), or approximate blocks of the raw bytes.
fn prompt_blocks(kv: &KvState, model: Option<&str>, prompt: Prompt<'_>) -> Option<PromptBlocks> {
    let lora = || model.and_then(|m| kv.lora_for(m));
    match prompt {
        Prompt::None => None,
        Prompt::Blocks(b) => Some(b.clone()),
        Prompt::TokenIds(ids) => {
            Some(kv.blocks_from_owned_tokens(ids, lora().as_deref(), PrefixMode::TokenIds))
        }
        Prompt::Tokens(ids) => {
            Some(kv.blocks_from_owned_tokens(ids, lora().as_deref(), PrefixMode::Tokens))
        }
        Prompt::Pieces(pieces) => {
            Some(kv.blocks_from_pieces(pieces, lora().as_deref(), PrefixMode::Tokens))
        }
        Prompt::TokenIdPieces(pieces) => {
            Some(kv.blocks_from_pieces(pieces, lora().as_deref(), PrefixMode::TokenIds))
        }
        Prompt::Text { scope, bytes } => Some(kv.blocks_from_text(scope, bytes)),
        Prompt::Hashes { hashes, isl_tokens } => Some(PromptBlocks {
            mode: PrefixMode::TokenIds,
            locals: Vec::new(),
            hashes: hashes.into(),
            isl_tokens,
        }),
    }
}

#[cfg(test)]
mod tests;
