//! Flow control: when every eligible endpoint is saturated, requests wait in kvepp instead of
//! being shed at once, and are routed as soon as capacity frees, the most important first.
//!
//! It owns the waiting line (the core's [`FlowQueue`]: priority, then flows in turn, then arrival)
//! and one dispatcher task. A waiting request holds a [`Ticket`]; the dispatcher, woken whenever a
//! booking is released (and every few milliseconds while anyone waits, for saturation that comes
//! from engine metrics), hands the head of the line a [`Grant`] while some endpoint has capacity.
//! The grantee routes (only to an unsaturated endpoint) and reports whether it placed the request;
//! if it could not (its subset hint names only saturated endpoints, or a new arrival took the
//! slot), it goes back to the head of its flow and the dispatcher waits for the next release.
//!
//! Invariants:
//! - while anyone waits, new arrivals queue behind them (they do not take freed capacity first);
//! - one grant is outstanding at a time, so a freed slot goes to exactly one waiter;
//! - a ticket leaves the queue when its request is placed, times out, or its stream goes away
//!   (drop), and every departure is counted once in `kvepp_flow_control_dequeued_total`;
//! - shedding (429) happens only for sheddable priorities whose queue is full; a request that
//!   waited past `max_wait_ms` gets 503;
//! - with a TTFT objective, a grantee that found capacity but no endpoint predicted within what
//!   is left of its objective goes to the back of its flow and the turn passes to the next waiter
//!   (at most `MAX_PASSES` passes in a round, and no more than requests waited when it began),
//!   so one request that does not fit never holds the others up; it is refused (503, 429 if
//!   sheddable) once its objective has passed.

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvepp_core::{FlowQueue, QueueFull, QueueId};
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, watch, Notify};

use crate::metrics::{OutcomeLabels, PoolModelLabels, PriorityLabels, Register};
use crate::routing::RouteRequest;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// The request header that names a request's flow (the fairness key) by default.
pub(crate) const FAIRNESS_HEADER: &str = "x-llm-d-inference-fairness-id";

/// How often the dispatcher re-checks capacity while requests wait and no booking was released
/// (saturation that comes from engine metrics ends without a release).
const RECHECK: Duration = Duration::from_millis(5);

/// Waiters outside their TTFT budget tried per round (each round is a wake-up: a release, or
/// the recheck while requests wait): bounds the picks spent on requests that do not fit yet.
const MAX_PASSES: usize = 8;

/// How long the dispatcher waits for a grantee to report before it moves on.
const GRANT_ANSWER: Duration = Duration::from_secs(1);

/// `flow_control` in the configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct FlowControlSettings {
    /// Queue requests that find every eligible endpoint saturated (off: shed sheddable ones at
    /// once and route the rest to saturated endpoints, as the reference EPP does without its
    /// flow-control feature).
    pub enabled: bool,
    /// Requests that may wait per priority; beyond it sheddable requests get 429 and others are
    /// routed at once.
    pub max_queue_per_priority: usize,
    /// Longest wait before a 503; keep it below the proxy's ext_proc `message_timeout`.
    pub max_wait_ms: u64,
    /// Request header whose value names the flow (requests of one flow are served in turn with
    /// other flows of the same priority); absent: the default flow.
    pub fairness_header: String,
    /// Time-to-first-token objective in ms (0: none). With it, under the `predicted_ttft` cost
    /// model, a request waits while no endpoint is predicted to give its first token within what
    /// is left of the objective, and is answered 503 (429 if sheddable) once the objective has
    /// passed (or `max_wait_ms`, if shorter): under overload the requests admitted keep the
    /// objective and the rest are refused within it instead of queueing for seconds.
    pub ttft_objective_ms: u64,
}

impl Default for FlowControlSettings {
    fn default() -> Self {
        FlowControlSettings {
            enabled: false,
            max_queue_per_priority: 1024,
            max_wait_ms: 5_000,
            fairness_header: FAIRNESS_HEADER.into(),
            ttft_objective_ms: 0,
        }
    }
}

impl FlowControlSettings {
    /// How long a request may wait in the queue: `max_wait_ms`, or the TTFT objective when it is
    /// shorter (past it, no placement can meet it).
    pub(crate) fn wait_bound(&self) -> Duration {
        let ms = match self.ttft_objective_ms {
            0 => self.max_wait_ms,
            o => o.min(self.max_wait_ms),
        };
        Duration::from_millis(ms)
    }

    /// What is left of the TTFT objective for a request that arrived at `arrived` (None: no
    /// objective).
    pub(crate) fn ttft_budget_ms(&self, arrived: Instant) -> Option<f64> {
        (self.ttft_objective_ms > 0)
            .then(|| self.ttft_objective_ms as f64 - arrived.elapsed().as_secs_f64() * 1000.0)
    }

    /// One message per bad field.
    pub(crate) fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !(1..=1_000_000).contains(&self.max_queue_per_priority) {
            out.push(format!(
                "max_queue_per_priority {} must be between 1 and 1000000",
                self.max_queue_per_priority
            ));
        }
        if !(1..=600_000).contains(&self.max_wait_ms) {
            out.push(format!(
                "max_wait_ms {} must be between 1 and 600000",
                self.max_wait_ms
            ));
        }
        if self.ttft_objective_ms > 600_000 {
            out.push(format!(
                "ttft_objective_ms {} must be at most 600000 (0: none)",
                self.ttft_objective_ms
            ));
        }
        let h = &self.fairness_header;
        if h.is_empty()
            || h.bytes()
                .any(|b| !(b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'))
        {
            out.push(format!(
                "fairness_header {h:?} must be a lowercase HTTP header name"
            ));
        }
        out
    }
}

/// Flow control: who waits, and for how long, by priority.
#[derive(Debug, Clone)]
pub struct FlowMetrics {
    /// Requests waiting for capacity now.
    pub queue_size: Family<PriorityLabels, Gauge>,
    /// Time from queueing to leaving the queue (dispatched, shed, timed out or gone).
    pub queue_wait: Family<PriorityLabels, Histogram, fn() -> Histogram>,
    /// Requests that left the queue, by outcome (`dispatched`, `timeout`, `cancelled`).
    pub outcomes: Family<OutcomeLabels, Counter>,
    /// Requests waiting because the pool has no ready endpoint (scale from zero), by pool and
    /// target model: what an autoscaler reads to start the first engine.
    pub waiting_for_endpoints: Family<PoolModelLabels, Gauge>,
    /// The pool's name (the `pool` label).
    pub pool: Arc<str>,
}

impl Default for FlowMetrics {
    fn default() -> Self {
        fn wait_buckets() -> Histogram {
            Histogram::new(exponential_buckets(1e-3, 2.0, 18))
        }
        FlowMetrics {
            queue_size: Family::default(),
            queue_wait: Family::new_with_constructor(wait_buckets),
            outcomes: Family::default(),
            waiting_for_endpoints: Family::default(),
            pool: "".into(),
        }
    }
}

impl Register for FlowMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "flow_control_queue_size",
            "Requests waiting in flow control's queue for capacity, by priority",
            self.queue_size.clone(),
        );
        registry.register(
            "flow_control_queue_wait_seconds",
            "Time requests spent in flow control's queue, by priority",
            self.queue_wait.clone(),
        );
        registry.register(
            "flow_control_dequeued",
            "Requests that left flow control's queue, by outcome (dispatched, timeout, cancelled)",
            self.outcomes.clone(),
        );
        registry.register(
            "flow_control_waiting_for_endpoints",
            "Requests waiting in flow control's queue because the pool has no ready endpoint (scale from zero), by pool and target model",
            self.waiting_for_endpoints.clone(),
        );
    }
}

/// A request counted in `kvepp_flow_control_waiting_for_endpoints` while it lives (the request
/// waits for the pool's first ready endpoint); dropping it uncounts the request.
#[derive(Debug)]
pub struct EndpointWait(Gauge);

impl Drop for EndpointWait {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// A waiting request as the queue holds it.
#[derive(Debug)]
struct Waiter {
    tx: oneshot::Sender<Grant>,
}

/// The queue and its dispatcher's wake-up.
#[derive(Debug)]
pub struct FlowControl {
    /// Replaced whole on a reload ([`FlowControl::reconfigure`]); each decision reads it once.
    settings: arc_swap::ArcSwap<FlowControlSettings>,
    queue: Mutex<FlowQueue<Waiter>>,
    wake: Notify,
    metrics: FlowMetrics,
}

/// What a grantee made of its turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Placed,
    /// No capacity after all: the dispatcher waits for the next release.
    NotPlaced,
    /// Capacity, but no endpoint within the request's TTFT budget: the next waiter may fit.
    Unfit,
}

/// A waiting request's turn: route now, then say whether the request was placed.
#[derive(Debug)]
pub struct Grant {
    ack: Option<oneshot::Sender<Answer>>,
}

impl Grant {
    /// Reports whether the request was placed (false: the dispatcher waits for the next release).
    pub(crate) fn done(self, placed: bool) {
        self.answer(if placed {
            Answer::Placed
        } else {
            Answer::NotPlaced
        });
    }

    /// Reports that the request found capacity but no endpoint within its TTFT budget: the
    /// dispatcher offers the turn to the next waiter.
    pub(crate) fn unfit(self) {
        self.answer(Answer::Unfit);
    }

    fn answer(mut self, a: Answer) {
        if let Some(ack) = self.ack.take() {
            let _ = ack.send(a);
        }
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        if let Some(ack) = self.ack.take() {
            let _ = ack.send(Answer::NotPlaced);
        }
    }
}

/// What a waiting request got.
#[derive(Debug)]
pub enum Turn {
    Granted(Grant),
    /// Waited `max_wait_ms` without a turn.
    TimedOut(Duration),
    /// The dispatcher is gone (shutdown): route without waiting.
    Closed,
}

/// A request's place in the queue; dropping it leaves the queue.
#[derive(Debug)]
pub struct Ticket {
    fc: Arc<FlowControl>,
    id: QueueId,
    priority: i32,
    flow: Arc<str>,
    rx: oneshot::Receiver<Grant>,
    since: Instant,
    queued: bool,
    finished: bool,
}

impl FlowControl {
    pub(crate) fn new(settings: FlowControlSettings, metrics: FlowMetrics) -> Arc<Self> {
        Arc::new(FlowControl {
            queue: Mutex::new(FlowQueue::new(settings.max_queue_per_priority)),
            settings: arc_swap::ArcSwap::from_pointee(settings),
            wake: Notify::new(),
            metrics,
        })
    }

    /// The settings requests use now.
    pub(crate) fn settings(&self) -> Arc<FlowControlSettings> {
        self.settings.load_full()
    }

    /// Counts a request for `model` as waiting for the pool's first ready endpoint, until the
    /// returned mark is dropped.
    pub(crate) fn awaits_endpoint(&self, model: &Arc<str>) -> EndpointWait {
        let labels = PoolModelLabels {
            pool: self.metrics.pool.clone(),
            model: model.clone(),
        };
        let gauge = self
            .metrics
            .waiting_for_endpoints
            .get_or_create(&labels)
            .clone();
        gauge.inc();
        EndpointWait(gauge)
    }

    /// Whether requests queue now (`enabled`; off: the stream sheds as without flow control).
    pub(crate) fn enabled(&self) -> bool {
        self.settings.load().enabled
    }

    /// Live reconfiguration: the queue bound, the longest wait (for requests queued from now
    /// on), the fairness header and whether new requests queue at all. Requests already waiting
    /// keep their place; turning it off lets them finish their wait or be dispatched.
    pub(crate) fn reconfigure(&self, settings: FlowControlSettings) {
        self.lock().set_capacity(settings.max_queue_per_priority);
        self.settings.store(Arc::new(settings));
        self.wake.notify_one();
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, FlowQueue<Waiter>> {
        self.queue.lock()
    }

    fn gauge(&self, q: &FlowQueue<Waiter>, priority: i32) {
        self.metrics
            .queue_size
            .get_or_create(&PriorityLabels {
                priority: priority.into(),
            })
            .set(q.len_at(priority) as i64);
    }

    /// True while requests wait: a new arrival must queue behind them.
    pub(crate) fn busy(&self) -> bool {
        !self.lock().is_empty()
    }

    /// Requests waiting now.
    pub(crate) fn waiting(&self) -> usize {
        self.lock().len()
    }

    /// A booking was released (or an endpoint came back): the dispatcher re-checks capacity.
    pub(crate) fn capacity_freed(&self) {
        self.wake.notify_one();
    }

    /// Queues a request of `priority` in `flow`.
    pub(crate) fn enqueue(
        self: &Arc<Self>,
        priority: i32,
        flow: &str,
    ) -> Result<Ticket, QueueFull> {
        let (tx, rx) = oneshot::channel();
        let mut q = self.lock();
        let id = q
            .push(priority, flow, Waiter { tx })
            .map_err(|(full, _)| full)?;
        self.gauge(&q, priority);
        drop(q);
        // Capacity may have freed between the caller's pick and now.
        self.wake.notify_one();
        Ok(Ticket {
            fc: self.clone(),
            id,
            priority,
            flow: flow.into(),
            rx,
            since: Instant::now(),
            queued: true,
            finished: false,
        })
    }

    /// The dispatcher: hands out turns while the pool has capacity, until `shutdown`.
    pub(crate) async fn dispatch(
        self: Arc<Self>,
        routing: Arc<dyn RouteRequest>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        loop {
            let recheck = async {
                if self.busy() {
                    tokio::time::sleep(RECHECK).await
                } else {
                    std::future::pending().await
                }
            };
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = recheck => {}
                _ = shutdown.changed() => return,
            }
            // Nothing waits (flow control off, or an empty queue): no capacity check at all.
            // Turns passed on by requests outside their TTFT budget are bounded by how many
            // waited when this round began (each such request went to the back) and by
            // MAX_PASSES: a long line of such requests is tried a few at a time, in turn.
            let mut passes = self.waiting().min(MAX_PASSES);
            while self.busy() && routing.has_capacity() {
                let next = {
                    let mut q = self.lock();
                    let next = q.pop();
                    if let Some((_, priority, _, _)) = &next {
                        self.gauge(&q, *priority);
                    }
                    next
                };
                let Some((_, _, _, waiter)) = next else { break };
                let (ack, answer) = oneshot::channel();
                if waiter.tx.send(Grant { ack: Some(ack) }).is_err() {
                    continue; // its stream went away meanwhile
                }
                let answer = tokio::time::timeout(GRANT_ANSWER, answer)
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .unwrap_or(Answer::NotPlaced);
                match answer {
                    Answer::Placed => {}
                    Answer::Unfit if passes > 1 => passes -= 1,
                    Answer::Unfit | Answer::NotPlaced => break,
                }
            }
        }
    }
}

/// Flow control listens to the router's bookings: each release may have freed capacity.
impl kvepp_core::Listener for FlowControl {
    fn released(&self) {
        // Only a waiting request needs the dispatcher (an arrival wakes it itself).
        if self.busy() {
            self.capacity_freed();
        }
    }
}

impl Ticket {
    /// Waits for this request's turn, at most [`FlowControlSettings::wait_bound`] after it was
    /// queued.
    pub(crate) async fn turn(&mut self) -> Turn {
        let deadline = self.since + self.fc.settings().wait_bound();
        match tokio::time::timeout_at(deadline.into(), &mut self.rx).await {
            Ok(Ok(grant)) => {
                self.queued = false;
                Turn::Granted(grant)
            }
            Ok(Err(_)) => Turn::Closed,
            Err(_) => Turn::TimedOut(self.since.elapsed()),
        }
    }

    /// The turn did not place the request: back to the head of its flow, same id.
    pub(crate) fn requeue(&mut self) {
        let (tx, rx) = oneshot::channel();
        self.rx = rx;
        let mut q = self.fc.lock();
        q.push_front(self.id, self.priority, &self.flow, Waiter { tx });
        self.fc.gauge(&q, self.priority);
        self.queued = true;
    }

    /// The turn found no endpoint within the request's TTFT budget: to the back of its flow
    /// (others may fit meanwhile), or its head when the queue is full.
    pub(crate) fn requeue_back(&mut self) {
        let (tx, rx) = oneshot::channel();
        self.rx = rx;
        let mut q = self.fc.lock();
        match q.push(self.priority, &self.flow, Waiter { tx }) {
            Ok(id) => self.id = id,
            Err((_, w)) => q.push_front(self.id, self.priority, &self.flow, w),
        }
        self.fc.gauge(&q, self.priority);
        self.queued = true;
    }

    /// The request left the queue with `outcome` (`dispatched`, `timeout`).
    pub(crate) fn finish(mut self, outcome: &'static str) {
        self.record(outcome);
    }

    fn record(&mut self, outcome: &'static str) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        if self.queued {
            let mut q = self.fc.lock();
            q.remove(self.id);
            self.fc.gauge(&q, self.priority);
            self.queued = false;
        }
        let m = &self.fc.metrics;
        m.queue_wait
            .get_or_create(&PriorityLabels {
                priority: self.priority.into(),
            })
            .observe(self.since.elapsed().as_secs_f64());
        m.outcomes.get_or_create(&OutcomeLabels { outcome }).inc();
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // Not finished: the stream went away while waiting.
        self.record("cancelled");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_checked() {
        assert!(FlowControlSettings::default().problems().is_empty());
        let bad = FlowControlSettings {
            enabled: true,
            max_queue_per_priority: 0,
            max_wait_ms: 0,
            fairness_header: "X Tenant".into(),
            ttft_objective_ms: 600_001,
        };
        assert_eq!(bad.problems().len(), 4, "{:?}", bad.problems());
        let s = FlowControlSettings {
            ttft_objective_ms: 1000,
            ..FlowControlSettings::default()
        };
        assert_eq!(s.wait_bound(), Duration::from_millis(1000));
        assert_eq!(
            FlowControlSettings::default().wait_bound(),
            Duration::from_millis(5000)
        );
        let budget = s.ttft_budget_ms(Instant::now()).unwrap();
        assert!(budget <= 1000.0 && budget > 900.0, "{budget}");
        assert_eq!(
            FlowControlSettings::default().ttft_budget_ms(Instant::now()),
            None
        );
    }

    #[tokio::test]
    async fn dropped_tickets_leave_the_queue_and_are_counted() {
        let fc = FlowControl::new(
            FlowControlSettings {
                max_queue_per_priority: 2,
                ..Default::default()
            },
            FlowMetrics::default(),
        );
        let a = fc.enqueue(0, "x").unwrap();
        let b = fc.enqueue(0, "y").unwrap();
        assert!(fc.busy());
        assert_eq!(fc.enqueue(0, "z").unwrap_err().capacity, 2);
        assert!(fc.enqueue(-1, "z").is_ok(), "another priority has room");
        drop(a);
        assert_eq!(fc.waiting(), 1);
        b.finish("timeout");
        assert_eq!(fc.waiting(), 0);
        let counted = |o: &'static str| {
            fc.metrics
                .outcomes
                .get_or_create(&OutcomeLabels { outcome: o })
                .get()
        };
        assert_eq!((counted("cancelled"), counted("timeout")), (2, 1));
    }

    /// Always has capacity; nothing else is asked of it.
    #[derive(Debug)]
    struct Open;

    impl RouteRequest for Open {
        fn prepare(
            &self,
            _: Option<&bytes::Bytes>,
            _: &crate::routing::RequestHead<'_>,
        ) -> Result<crate::routing::Prepared, crate::routing::Rejection> {
            Err(crate::routing::Rejection::new(500, "test", "unused"))
        }
        fn decide(
            &self,
            _: &crate::routing::Prepared,
            _: &crate::routing::RouteHints<'_>,
        ) -> Result<crate::routing::Verdict, crate::routing::Rejection> {
            Err(crate::routing::Rejection::new(500, "test", "unused"))
        }
        fn has_capacity(&self) -> bool {
            true
        }
        fn endpoint(&self, _: std::net::SocketAddr) -> Option<Arc<kvepp_core::Endpoint>> {
            None
        }
    }

    /// A head outside its TTFT budget passes its turn to the next waiter at once (no release
    /// needed) and goes behind it; a head short of capacity holds the round.
    #[tokio::test]
    async fn an_unfit_head_passes_its_turn_to_the_next_waiter() {
        let fc = FlowControl::new(FlowControlSettings::default(), FlowMetrics::default());
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut a = fc.enqueue(0, "").unwrap();
        let mut b = fc.enqueue(0, "").unwrap();
        let task = tokio::spawn(fc.clone().dispatch(Arc::new(Open), stop_rx));
        let Turn::Granted(g) = a.turn().await else {
            panic!("a first")
        };
        g.unfit();
        a.requeue_back();
        let Turn::Granted(g) = b.turn().await else {
            panic!("b next, in the same round")
        };
        g.done(true);
        b.finish("dispatched");
        // a is granted again (the recheck while it waits) and placed.
        let Turn::Granted(g) = a.turn().await else {
            panic!("a again")
        };
        g.done(true);
        a.finish("dispatched");
        assert_eq!(fc.waiting(), 0);
        stop_tx.send(true).unwrap();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn a_waiter_times_out_after_max_wait() {
        let fc = FlowControl::new(
            FlowControlSettings {
                max_wait_ms: 20,
                ..Default::default()
            },
            FlowMetrics::default(),
        );
        let mut t = fc.enqueue(3, "").unwrap();
        assert!(matches!(t.turn().await, Turn::TimedOut(d) if d >= Duration::from_millis(20)));
    }
}
