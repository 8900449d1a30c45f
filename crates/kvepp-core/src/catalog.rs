//! The worker catalog of the standalone selection and slot-tracker services: workers registered by
//! their clients, grouped by (model, tenant) scope, each scope with its own KV-aware state (prefix
//! index, slot tracker, block size), and the reservations booked through them.
//!
//! Invariants:
//! - every scope holds at least one worker; a scope's workers share one block size (the first
//!   worker's); a scope disappears with its last worker, and with it its index and bookings;
//! - a worker's ranks `[dp_start, dp_start + dp_size)` are registered in its scope's slot tracker
//!   and nothing outside them is schedulable; unregistering a worker removes its ranks, active
//!   requests and cached blocks;
//! - in pooled mode (`kvepp serve`) there is one scope, shared with the ext_proc picker, whose
//!   workers are the discovered endpoints: it is never registered or unregistered through here;
//! - a reservation id is active in at most one scope; the catalog remembers which (bounded by
//!   [`Limits::max_reservations`]), and forgets it when freed or expired.
//!
//! - every reservation this process decides is a [`Booking`] held in the catalog's map until it is
//!   freed or expires: dropping it is the only way its load is released, and its drop tells the
//!   scope's listeners (replica sync); a peer's reservation is recorded by id and freed by id.
//!
//! Selection and reservation go through each scope's [`Router`] (the core's one transaction) over
//! the scope's candidates: one [`Endpoint::for_rank`] per registered rank, or in pooled mode the
//! pool's own endpoints under the ext_proc door's own router, so both doors answer alike. Nothing
//! here ranks candidates, books load or retries.

use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use crate::affinity::{SessionAffinity, SessionKey, SessionOutcome};
use crate::booking::Booking;
use crate::cost::{CandidateLoad, Overlap};
use crate::hash::SequenceHash;
use crate::index::RankDump;
use crate::kv::{KvSettings, KvState};
use crate::listen::Listener;
use crate::pick::{Endpoint, PickContext, PickError, Saturation};
use crate::router::{Decision, Prompt, RequestFacts, Router};
use crate::slots::{PotentialLoad, RankLoad, SlotError, WorkerRank};

mod reservations;

pub use reservations::Origin;
use reservations::{choice_of, pick_error, HeldBooking, Key};

/// One rank's standing for one request in a selection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankChoice {
    pub rank: WorkerRank,
    /// Cached prefix on the rank, in blocks.
    pub overlap: Overlap,
    pub cost: f64,
    /// Prompt tokens the rank still has to prefill given its cache (what a reservation books).
    pub effective_prefill_tokens: u64,
    pub load: CandidateLoad,
}

/// The (model, tenant) pair that scopes workers, the index and load.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope {
    pub model: String,
    pub tenant: String,
}

/// One registered worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    pub worker_id: u64,
    pub block_size: u32,
    pub dp_start: u32,
    pub dp_size: u32,
    /// Where clients reach it (selection service), if given.
    pub endpoint: Option<String>,
    /// KV-event publisher per data-parallel rank (selection service).
    pub kv_events_endpoints: BTreeMap<u32, String>,
    pub replay_endpoint: Option<String>,
}

impl Worker {
    pub fn ranks(&self) -> impl Iterator<Item = WorkerRank> + '_ {
        (self.dp_start..self.dp_start + self.dp_size).map(|dp_rank| WorkerRank {
            worker: self.worker_id,
            dp_rank,
        })
    }

    pub fn has_rank(&self, dp_rank: u32) -> bool {
        dp_rank >= self.dp_start && dp_rank - self.dp_start < self.dp_size
    }
}

/// Bounds on what clients can make the catalog hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_workers: usize,
    pub max_ranks_per_worker: u32,
    pub max_reservations: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_workers: 4096,
            max_ranks_per_worker: 1024,
            max_reservations: 1 << 20,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CatalogError {
    #[error("block_size must be positive")]
    ZeroBlockSize,
    #[error("data-parallel size must be positive")]
    ZeroDpSize,
    #[error("data-parallel range {start} + {size} overflows")]
    DpRangeOverflow { start: u32, size: u32 },
    #[error("data-parallel size {size} is above the limit of {limit}")]
    TooManyRanks { size: u32, limit: u32 },
    #[error("model {model:?} tenant {tenant:?} uses block size {have}, not {got}")]
    BlockSizeMismatch {
        model: String,
        tenant: String,
        have: u32,
        got: u32,
    },
    #[error("no workers registered for model {model:?} tenant {tenant:?}")]
    UnknownScope { model: String, tenant: String },
    #[error("worker {0} is not registered")]
    UnknownWorker(u64),
    #[error("worker {worker} has no data-parallel rank {dp_rank}")]
    UnknownRank { worker: u64, dp_rank: u32 },
    #[error("reservation {0:?} is not active")]
    UnknownReservation(String),
    #[error("reservation {0:?} is already active")]
    DuplicateReservation(String),
    #[error("effective_prefill_tokens {effective} exceeds the input length {isl}")]
    EffectiveAboveInput { effective: u64, isl: u64 },
    #[error("the catalog holds {0} workers, the limit")]
    TooManyWorkers(usize),
    #[error("{0} reservations are active, the limit")]
    TooManyReservations(usize),
    #[error("workers come from discovery here; they cannot be registered or removed over HTTP")]
    Pooled,
    /// The pool refused the request (pooled mode: topology, saturation of sheddable requests).
    #[error("{0}")]
    Refused(String),
}

impl From<SlotError> for CatalogError {
    fn from(e: SlotError) -> Self {
        match e {
            SlotError::UnknownRank(r) => CatalogError::UnknownRank {
                worker: r.worker,
                dp_rank: r.dp_rank,
            },
            SlotError::DuplicateRequest(id) => CatalogError::DuplicateReservation(id),
            SlotError::UnknownRequest(id) => CatalogError::UnknownReservation(id),
        }
    }
}

/// One scope's workers and state.
#[derive(Debug)]
pub struct Tracker {
    pub kv: Arc<KvState>,
    pub workers: BTreeMap<u64, Worker>,
    /// The one transaction over `kv` (pooled mode: the ext_proc door's own router).
    router: Arc<Router>,
    /// What a selection picks among: one candidate per registered rank, or the pool's endpoints.
    candidates: Vec<Arc<Endpoint>>,
}

impl Tracker {
    /// The scope's transaction (its session bindings among its state).
    pub fn router(&self) -> &Router {
        &self.router
    }

    fn new(kv: Arc<KvState>, sessions: &SessionAffinity) -> Self {
        let router = Router::kv_aware(kv.clone(), Saturation::in_flight(0));
        Tracker {
            router: Arc::new(router.with_sessions(sessions.table())),
            kv,
            workers: BTreeMap::new(),
            candidates: Vec::new(),
        }
    }

    /// One candidate per registered rank, keeping the candidates (and their load counters) of
    /// ranks registered before.
    fn rebuild_candidates(&mut self) {
        let old: HashMap<WorkerRank, Arc<Endpoint>> =
            self.candidates.drain(..).map(|e| (e.rank(), e)).collect();
        let mut fresh = Vec::new();
        for w in self.workers.values() {
            let name = w
                .endpoint
                .clone()
                .unwrap_or_else(|| w.worker_id.to_string());
            for r in w.ranks() {
                let e = old
                    .get(&r)
                    .cloned()
                    .unwrap_or_else(|| Arc::new(Endpoint::for_rank(r, name.as_str())));
                fresh.push(e);
            }
        }
        self.candidates = fresh;
    }

    /// The candidate of `rank`, when it is registered.
    fn candidate(&self, rank: WorkerRank) -> Option<&Arc<Endpoint>> {
        self.candidates.iter().find(|e| e.rank() == rank)
    }

    pub fn block_size(&self) -> u32 {
        self.kv.block_size()
    }

    pub fn ranks(&self) -> Vec<WorkerRank> {
        self.workers.values().flat_map(Worker::ranks).collect()
    }
}

/// A chosen worker rank with the overlap summary the services answer with.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    pub worker: Worker,
    pub choice: RankChoice,
    pub block_size: u32,
    /// Cached prefix per rank of the chosen worker, in blocks (ranks without any: 0).
    pub per_rank: BTreeMap<u32, Overlap>,
    /// What the selection did to the request's session binding (None: no session).
    pub session: Option<SessionOutcome>,
}

/// A prompt as the services receive it: the final chained sequence hashes, one per block, and the
/// input length in tokens.
#[derive(Debug, Clone, Copy)]
pub struct PromptRef<'a> {
    pub hashes: &'a [SequenceHash],
    pub isl_tokens: u64,
}

/// What the catalog's transaction is asked to decide (`Catalog::decide`).
struct Ask<'a> {
    prompt: PromptRef<'a>,
    /// Prefill tokens to book; None: what the cost computed.
    prefill: Option<u64>,
    session: Option<SessionKey>,
    candidates: &'a [Arc<Endpoint>],
    /// Book, and keep the booking under it; None: preview.
    key: Option<Key>,
    now: Instant,
}

/// Makes the listener of a new scope's bookings (replica sync publishes them under the scope).
pub type ListenerFor = Arc<dyn Fn(&Scope) -> Option<Arc<dyn Listener>> + Send + Sync>;

/// Workers, their scopes' state and the reservations.
pub struct Catalog {
    settings: KvSettings,
    limits: Limits,
    scopes: BTreeMap<Scope, Tracker>,
    /// Pooled mode: every scope resolves to this one.
    pooled: Option<Tracker>,
    reservations: Mutex<HashMap<Key, HeldBooking>>,
    listener_for: Option<ListenerFor>,
    /// Recovered index content of scopes with no worker yet: applied when the scope's first worker
    /// registers with the same block size.
    pending: HashMap<Scope, (u32, Vec<RankDump>)>,
    /// How each scope's router keeps session bindings.
    sessions: SessionAffinity,
}

impl std::fmt::Debug for Catalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Catalog")
            .field("scopes", &self.scopes.keys().collect::<Vec<_>>())
            .field("pooled", &self.pooled.is_some())
            .field("reservations", &self.reservation_count())
            .finish()
    }
}

impl Catalog {
    /// A catalog of registered workers; each new scope gets a [`KvState`] with these settings
    /// (its block size is the first worker's).
    pub fn new(settings: KvSettings, limits: Limits) -> Self {
        Catalog {
            settings,
            limits,
            scopes: BTreeMap::new(),
            pooled: None,
            reservations: Mutex::new(HashMap::new()),
            listener_for: None,
            pending: HashMap::new(),
            sessions: SessionAffinity::default(),
        }
    }

    /// Each scope created from now on keeps session bindings as `sessions` says (time to live,
    /// size).
    pub fn with_sessions(mut self, sessions: SessionAffinity) -> Self {
        self.sessions = sessions;
        self
    }

    /// Every scope created from now on gets `f`'s listener (replica sync).
    pub fn set_listeners(&mut self, f: ListenerFor) {
        self.listener_for = Some(f);
    }

    /// One scope shared with the ext_proc door: every (model, tenant) resolves to `router`'s
    /// KV-aware state and picks through `router` itself; its workers are the endpoints
    /// [`Catalog::set_pool`] is given. None when the router is not KV-aware.
    pub fn pooled(router: Arc<Router>, limits: Limits) -> Option<Self> {
        let kv = router.kv()?.clone();
        Some(Catalog {
            settings: *kv.settings(),
            limits,
            scopes: BTreeMap::new(),
            pooled: Some(Tracker {
                kv,
                workers: BTreeMap::new(),
                router,
                candidates: Vec::new(),
            }),
            reservations: Mutex::new(HashMap::new()),
            listener_for: None,
            pending: HashMap::new(),
            // The pooled scope decides through the ext_proc door's router and its table.
            sessions: SessionAffinity::default(),
        })
    }

    /// Applies a peer's index content for `scope` (recovery): into the scope's index now, or when
    /// its first worker registers. A scope with another block size ignores it. Returns the
    /// pairs restored now.
    pub fn recover(
        &mut self,
        scope: Scope,
        block_size: u32,
        dumps: Vec<RankDump>,
    ) -> Result<u64, crate::index::IndexError> {
        match self.tracker(&scope) {
            Ok(t) if t.block_size() == block_size => t.kv.index().write(|ix| ix.restore(&dumps)),
            Ok(_) => Ok(0),
            Err(_) => {
                self.pending.insert(scope, (block_size, dumps));
                Ok(0)
            }
        }
    }

    pub fn is_pooled(&self) -> bool {
        self.pooled.is_some()
    }

    /// Pooled mode: the pool's ready endpoints (one worker of one rank each) are the candidates;
    /// their ranks become schedulable.
    pub fn set_pool(&mut self, endpoints: Vec<Arc<Endpoint>>) {
        if let Some(pool) = &mut self.pooled {
            let block_size = pool.kv.block_size();
            pool.workers = endpoints
                .iter()
                .map(|e| {
                    let w = Worker {
                        worker_id: e.worker,
                        block_size,
                        dp_start: 0,
                        dp_size: 1,
                        endpoint: Some(format!("http://{}", e.addr_str)),
                        kv_events_endpoints: BTreeMap::new(),
                        replay_endpoint: None,
                    };
                    (e.worker, w)
                })
                .collect();
            for r in pool.ranks() {
                pool.kv.register_rank(r);
            }
            pool.candidates = endpoints;
        }
    }

    pub fn tracker(&self, scope: &Scope) -> Result<&Tracker, CatalogError> {
        self.pooled
            .as_ref()
            .or_else(|| self.scopes.get(scope))
            .ok_or_else(|| CatalogError::UnknownScope {
                model: scope.model.clone(),
                tenant: scope.tenant.clone(),
            })
    }

    /// Every scope with its tracker (pooled mode: one, under `pool_scope`).
    pub fn trackers<'a>(
        &'a self,
        pool_scope: &'a Scope,
    ) -> Box<dyn Iterator<Item = (&'a Scope, &'a Tracker)> + 'a> {
        match &self.pooled {
            Some(p) => Box::new(std::iter::once((pool_scope, p))),
            None => Box::new(self.scopes.iter()),
        }
    }

    pub fn worker_count(&self) -> usize {
        match &self.pooled {
            Some(p) => p.workers.len(),
            None => self.scopes.values().map(|t| t.workers.len()).sum(),
        }
    }

    /// Registers (or replaces) a worker in `scope`.
    pub fn register(&mut self, scope: Scope, worker: Worker) -> Result<(), CatalogError> {
        if self.pooled.is_some() {
            return Err(CatalogError::Pooled);
        }
        if worker.block_size == 0 {
            return Err(CatalogError::ZeroBlockSize);
        }
        if worker.dp_size == 0 {
            return Err(CatalogError::ZeroDpSize);
        }
        if worker.dp_start.checked_add(worker.dp_size).is_none() {
            return Err(CatalogError::DpRangeOverflow {
                start: worker.dp_start,
                size: worker.dp_size,
            });
        }
        if worker.dp_size > self.limits.max_ranks_per_worker {
            return Err(CatalogError::TooManyRanks {
                size: worker.dp_size,
                limit: self.limits.max_ranks_per_worker,
            });
        }
        let existing = self.scopes.get(&scope);
        if let Some(t) = existing {
            if t.block_size() != worker.block_size {
                return Err(CatalogError::BlockSizeMismatch {
                    model: scope.model,
                    tenant: scope.tenant,
                    have: t.block_size(),
                    got: worker.block_size,
                });
            }
        }
        let replaces = existing.is_some_and(|t| t.workers.contains_key(&worker.worker_id));
        if !replaces && self.worker_count() >= self.limits.max_workers {
            return Err(CatalogError::TooManyWorkers(self.limits.max_workers));
        }
        let settings = KvSettings {
            block_size: worker.block_size,
            learn_block_size: false,
            approximate_only: false,
            ..self.settings
        };
        let pending = self.pending.remove(&scope);
        let listener = self.listener_for.as_ref().and_then(|f| f(&scope));
        let tracker = self.scopes.entry(scope).or_insert_with(|| {
            let kv = Arc::new(KvState::new(settings));
            if let Some(l) = listener {
                kv.hub().listen(l);
            }
            Tracker::new(kv, &self.sessions)
        });
        if let Some((bs, dumps)) = pending.filter(|(bs, _)| *bs == worker.block_size) {
            if let Err(e) = tracker.kv.index().write(|ix| ix.restore(&dumps)) {
                tracing::warn!(error = %e, block_size = bs, "recovered index content partly applied");
            }
        }
        if let Some(old) = tracker.workers.get(&worker.worker_id) {
            // Ranks the new range no longer covers go, with their requests and blocks.
            if old.dp_start != worker.dp_start || old.dp_size != worker.dp_size {
                tracker.kv.remove_worker(worker.worker_id);
            }
        }
        for r in worker.ranks() {
            tracker.kv.register_rank(r);
        }
        tracker.workers.insert(worker.worker_id, worker);
        tracker.rebuild_candidates();
        Ok(())
    }

    /// Removes a worker from `scope` with its ranks, requests and blocks.
    pub fn unregister(&mut self, scope: &Scope, worker_id: u64) -> Result<Worker, CatalogError> {
        if self.pooled.is_some() {
            return Err(CatalogError::Pooled);
        }
        let tracker = self
            .scopes
            .get_mut(scope)
            .ok_or(CatalogError::UnknownWorker(worker_id))?;
        let worker = tracker
            .workers
            .remove(&worker_id)
            .ok_or(CatalogError::UnknownWorker(worker_id))?;
        tracker.kv.remove_worker(worker_id);
        tracker.rebuild_candidates();
        if tracker.workers.is_empty() {
            self.scopes.remove(scope);
        }
        Ok(worker)
    }

    /// The scopes a worker id is registered in.
    pub fn scopes_of(&self, worker_id: u64) -> Vec<Scope> {
        self.scopes
            .iter()
            .filter(|(_, t)| t.workers.contains_key(&worker_id))
            .map(|(s, _)| s.clone())
            .collect()
    }

    /// Chooses a rank for the prompt in `scope`; with `reserve`, books it atomically (the
    /// reservation held until [`Catalog::free`] or it expires).
    pub fn select(
        &self,
        scope: &Scope,
        prompt: PromptRef<'_>,
        reserve: Option<(&str, Instant)>,
        rng: &mut fastrand::Rng,
    ) -> Result<Selection, CatalogError> {
        self.select_in_session(scope, prompt, None, reserve, rng)
    }

    /// [`Self::select`] for a request of client session `session`: its bound rank while it can
    /// take the request; a reservation binds the session to its rank.
    pub fn select_in_session(
        &self,
        scope: &Scope,
        prompt: PromptRef<'_>,
        session: Option<SessionKey>,
        reserve: Option<(&str, Instant)>,
        rng: &mut fastrand::Rng,
    ) -> Result<Selection, CatalogError> {
        let tracker = self.tracker(scope)?;
        let found = tracker.kv.rank_overlaps(prompt.hashes);
        let now = reserve.map_or_else(Instant::now, |(_, now)| now);
        let key = reserve.map(|(id, _)| Key::global(id));
        let ask = Ask {
            prompt,
            prefill: None,
            session,
            candidates: &tracker.candidates,
            key,
            now,
        };
        let d = self.decide(scope, tracker, ask, rng)?;
        let choice = choice_of(&d, prompt.isl_tokens);
        let worker = tracker
            .workers
            .get(&choice.rank.worker)
            .cloned()
            .ok_or(CatalogError::UnknownWorker(choice.rank.worker))?;
        let per_rank = worker
            .ranks()
            .map(|r| {
                let o = found
                    .iter()
                    .find(|o| o.rank == r)
                    .map_or(Overlap::default(), |o| o.overlap);
                (r.dp_rank, o)
            })
            .collect();
        Ok(Selection {
            worker,
            choice,
            block_size: tracker.block_size(),
            per_rank,
            session: d.session,
        })
    }

    /// Runs the scope's transaction for `prompt` among `candidates` (booking `prefill` tokens
    /// when given, else what the cost computed); with `key`, books and keeps the booking under
    /// it (checked for room and duplicates under the map's lock, so two reservations of one id
    /// cannot both book), else previews. The one place the catalog decides.
    fn decide(
        &self,
        scope: &Scope,
        tracker: &Tracker,
        ask: Ask<'_>,
        rng: &mut fastrand::Rng,
    ) -> Result<Decision, CatalogError> {
        let Ask {
            prompt,
            prefill,
            session,
            candidates,
            key,
            now,
        } = ask;
        let facts = RequestFacts {
            prompt: Prompt::Hashes {
                hashes: prompt.hashes.to_vec(),
                isl_tokens: prompt.isl_tokens,
            },
            booking_id: key.as_ref().map(|k| k.id.as_str()),
            prefill_tokens: prefill,
            session,
            ..RequestFacts::default()
        };
        let mut ctx = PickContext::new(std::mem::replace(rng, fastrand::Rng::with_seed(0)), now);
        let Some(k) = key.as_ref() else {
            let d = tracker.router.preview(facts, candidates, &mut ctx);
            *rng = ctx.rng;
            return d.map_err(|e| pick_error(scope, e));
        };
        let mut map = self.reservations.lock();
        self.check_room(&map, k)?;
        let d = tracker.router.route(facts, candidates, &mut ctx);
        *rng = ctx.rng;
        let mut d = d.map_err(|e| pick_error(scope, e))?;
        // The facts (and their borrow of the id) are spent: the key moves into the map.
        if let Some(key) = key {
            let booking = std::mem::replace(&mut d.booking, Booking::none());
            map.insert(key, HeldBooking::local(scope, booking));
        }
        Ok(d)
    }

    fn check_room(&self, map: &HashMap<Key, HeldBooking>, key: &Key) -> Result<(), CatalogError> {
        if map.contains_key(key) {
            return Err(CatalogError::DuplicateReservation(key.id.clone()));
        }
        if map.len() >= self.limits.max_reservations {
            return Err(CatalogError::TooManyReservations(
                self.limits.max_reservations,
            ));
        }
        Ok(())
    }

    /// Books a reservation on a given rank (selection service: ids are global, the lifecycle
    /// routes name only the id). `effective_prefill_tokens` (≤ `isl_tokens`) is what loads
    /// prefill; when absent, the whole input does. Returns the prefill tokens booked.
    pub fn reserve(
        &self,
        scope: &Scope,
        id: &str,
        rank: WorkerRank,
        prompt: PromptRef<'_>,
        effective_prefill_tokens: Option<u64>,
        now: Instant,
    ) -> Result<u64, CatalogError> {
        let (tracker, prefill) =
            self.check_booking(scope, rank, prompt, effective_prefill_tokens)?;
        self.book_on(scope, tracker, Key::global(id), rank, prompt, prefill, now)?;
        Ok(prefill)
    }

    /// Books a request on a given rank with ids scoped by (model, tenant) (slot tracker: every
    /// lifecycle route names the scope). `prefill_tokens` load prefill until completion.
    pub fn add_scoped(
        &self,
        scope: &Scope,
        id: &str,
        rank: WorkerRank,
        hashes: &[SequenceHash],
        prefill_tokens: u64,
        now: Instant,
    ) -> Result<(), CatalogError> {
        let (tracker, prompt) = self.check_given(scope, rank, hashes, prefill_tokens)?;
        let key = Key::scoped(scope, id);
        self.book_on(scope, tracker, key, rank, prompt, prefill_tokens, now)
    }

    /// The transaction with `rank`'s candidate alone, booking `prefill` tokens under `key`.
    #[allow(clippy::too_many_arguments)]
    fn book_on(
        &self,
        scope: &Scope,
        tracker: &Tracker,
        key: Key,
        rank: WorkerRank,
        prompt: PromptRef<'_>,
        prefill: u64,
        now: Instant,
    ) -> Result<(), CatalogError> {
        let candidate = tracker.candidate(rank).ok_or(CatalogError::UnknownRank {
            worker: rank.worker,
            dp_rank: rank.dp_rank,
        })?;
        // One candidate: the choice is made; the random generator has nothing to break.
        let mut rng = fastrand::Rng::with_seed(0);
        let one = std::slice::from_ref(candidate);
        let ask = Ask {
            prompt,
            prefill: Some(prefill),
            session: None,
            candidates: one,
            key: Some(key),
            now,
        };
        self.decide(scope, tracker, ask, &mut rng)?;
        Ok(())
    }

    /// [`Self::check_booking`] of a booking whose prefill tokens are given (the whole input).
    fn check_given<'a>(
        &self,
        scope: &Scope,
        rank: WorkerRank,
        hashes: &'a [SequenceHash],
        prefill_tokens: u64,
    ) -> Result<(&Tracker, PromptRef<'a>), CatalogError> {
        let prompt = PromptRef {
            hashes,
            isl_tokens: prefill_tokens,
        };
        Ok((self.check_booking(scope, rank, prompt, None)?.0, prompt))
    }

    fn check_booking(
        &self,
        scope: &Scope,
        rank: WorkerRank,
        prompt: PromptRef<'_>,
        effective_prefill_tokens: Option<u64>,
    ) -> Result<(&Tracker, u64), CatalogError> {
        let tracker = self.tracker(scope)?;
        let worker = tracker
            .workers
            .get(&rank.worker)
            .ok_or(CatalogError::UnknownWorker(rank.worker))?;
        if !worker.has_rank(rank.dp_rank) {
            return Err(CatalogError::UnknownRank {
                worker: rank.worker,
                dp_rank: rank.dp_rank,
            });
        }
        let prefill = match effective_prefill_tokens {
            Some(e) if e > prompt.isl_tokens => {
                return Err(CatalogError::EffectiveAboveInput {
                    effective: e,
                    isl: prompt.isl_tokens,
                })
            }
            Some(e) => e,
            None => prompt.isl_tokens,
        };
        Ok((tracker, prefill))
    }

    /// Records a peer replica's booking (replica sync): by id, never told to the listeners.
    /// `scoped`: the id is scoped by (model, tenant) (the slot tracker's), else global.
    #[allow(clippy::too_many_arguments)]
    pub fn record_peer(
        &self,
        scope: &Scope,
        id: &str,
        rank: WorkerRank,
        hashes: &[SequenceHash],
        prefill_tokens: u64,
        scoped: bool,
        now: Instant,
    ) -> Result<(), CatalogError> {
        let (tracker, _) = self.check_given(scope, rank, hashes, prefill_tokens)?;
        let key = if scoped {
            Key::scoped(scope, id)
        } else {
            Key::global(id)
        };
        let mut map = self.reservations.lock();
        self.check_room(&map, &key)?;
        tracker.kv.reserve(id, rank, hashes, prefill_tokens, now)?;
        map.insert(key, HeldBooking::peer(scope));
        Ok(())
    }

    /// Current load of every rank of `scope`'s workers.
    pub fn loads(&self, tracker: &Tracker) -> Vec<(WorkerRank, RankLoad)> {
        let mut loads: Vec<(WorkerRank, RankLoad)> = tracker
            .kv
            .rank_loads()
            .into_iter()
            .filter(|(r, _)| {
                tracker
                    .workers
                    .get(&r.worker)
                    .is_some_and(|w| w.has_rank(r.dp_rank))
            })
            .collect();
        loads.sort_by_key(|(r, _)| *r);
        loads
    }

    /// Every rank's projected load for a prompt.
    pub fn potential_loads(
        &self,
        scope: &Scope,
        prompt: PromptRef<'_>,
    ) -> Result<Vec<PotentialLoad>, CatalogError> {
        let tracker = self.tracker(scope)?;
        Ok(tracker
            .kv
            .potential_loads(&tracker.ranks(), prompt.hashes, prompt.isl_tokens))
    }
}

#[cfg(test)]
mod tests;
