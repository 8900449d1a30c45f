//! Door equivalence: one random sequence of requests (prompts sharing prefixes), prefill
//! completions, frees and KV events, driven through the ext_proc door ([`Router::route`] with
//! token ids over the pool's endpoints), the HTTP door of `kvepp serve` (a pooled [`Catalog`] with
//! client-hashed prompts) and the standalone selection service (a [`Catalog`] of registered
//! workers, one rank each) over three copies of one fleet. Every step must pick the same worker,
//! book the same prefill, leave the same loads in the slot tracker, and tell the listeners (what
//! replica sync publishes) the same events, ids aside.

use std::sync::Mutex;

use super::*;
use crate::catalog::{Catalog, Limits, PromptRef, Scope, Worker};
use crate::cost::{CostModel, CostWeights};
use crate::hash::{local_block_hashes, sequence_hashes};
use crate::index::{EngineBlockHash, Tier};
use crate::kv::KvSettings;
use crate::listen::Admitted;
use crate::slots::WorkerRank;

const BLOCK: usize = 4;

/// What a listener heard, with each booking named by the order of its admission.
#[derive(Debug, Default)]
struct Heard {
    ids: Vec<String>,
    events: Vec<String>,
}

#[derive(Debug, Default)]
struct Recorder(Mutex<Heard>);

impl Recorder {
    fn name(h: &mut Heard, id: &str) -> usize {
        match h.ids.iter().position(|x| x == id) {
            Some(i) => i,
            None => {
                h.ids.push(id.to_owned());
                h.ids.len() - 1
            }
        }
    }

    fn events(&self) -> Vec<String> {
        self.0.lock().unwrap().events.clone()
    }
}

impl Listener for Recorder {
    fn admitted(&self, a: &Admitted<'_>) {
        let mut h = self.0.lock().unwrap();
        let n = Self::name(&mut h, a.id);
        let hashes: Vec<u64> = a.hashes.iter().map(|s| s.0).collect();
        let e = format!(
            "admit #{n} {}/{} bs{} {hashes:?} {}",
            a.rank.worker, a.rank.dp_rank, a.block_size, a.prefill_tokens
        );
        h.events.push(e);
    }
    fn prefill_complete(&self, id: &str) {
        let mut h = self.0.lock().unwrap();
        let n = Self::name(&mut h, id);
        h.events.push(format!("prefill #{n}"));
    }
    fn freed(&self, id: &str) {
        let mut h = self.0.lock().unwrap();
        let n = Self::name(&mut h, id);
        h.events.push(format!("free #{n}"));
    }
}

fn settings(weights: CostWeights) -> KvSettings {
    KvSettings {
        block_size: BLOCK as u32,
        weights,
        ..KvSettings::default()
    }
}

fn endpoints() -> Vec<Arc<Endpoint>> {
    // Ordered by worker id: the standalone catalog lists its ranks in that order, and ties are
    // broken at random over the candidates in order.
    let mut eps: Vec<Arc<Endpoint>> = (1..=5)
        .map(|i| {
            Arc::new(Endpoint::new(
                ([10, 0, 0, i], 8000).into(),
                format!("pod-{i}"),
            ))
        })
        .collect();
    eps.sort_by_key(|e| e.worker);
    eps
}

/// One fleet behind one door.
struct Fleet {
    kv: Arc<KvState>,
    heard: Arc<Recorder>,
}

impl Fleet {
    /// Every rank's load that is not idle (the HTTP doors register their ranks up front, the
    /// ext_proc door at its first booking there).
    fn loads(&self) -> Vec<(WorkerRank, crate::slots::RankLoad)> {
        let mut l = self.kv.rank_loads();
        l.retain(|(_, l)| *l != crate::slots::RankLoad::default());
        l.sort_by_key(|(r, _)| *r);
        l
    }

    /// A KV event: `tokens`' full blocks stored on (or removed from) `worker`'s rank 0.
    fn event(&self, worker: u64, tokens: &[u32], store: bool) {
        let locals = local_block_hashes(tokens, BLOCK, None);
        let seqs = sequence_hashes(&locals);
        let rank = WorkerRank { worker, dp_rank: 0 };
        self.kv.index().write(|ix| {
            if store {
                let blocks = seqs
                    .iter()
                    .zip(&locals)
                    .map(|(s, l)| (EngineBlockHash(s.0), *l));
                ix.store(rank, Tier::Device, None, blocks).unwrap();
            } else {
                ix.remove(
                    rank,
                    Tier::Device,
                    seqs.iter().map(|s| EngineBlockHash(s.0)),
                );
            }
        });
    }
}

fn fleet(weights: CostWeights) -> Fleet {
    let kv = Arc::new(KvState::new(settings(weights)));
    let heard = Arc::new(Recorder::default());
    kv.hub().listen(heard.clone());
    Fleet { kv, heard }
}

/// A prompt of one of a few families (shared stems) with a random tail.
fn tokens(rng: &mut fastrand::Rng) -> Vec<u32> {
    let family = rng.u32(..4);
    let mut t: Vec<u32> = (0..rng.u32(..40)).map(|i| family * 1000 + i).collect();
    t.extend((0..rng.usize(..9)).map(|_| rng.u32(10_000..)));
    t
}

fn scope() -> Scope {
    Scope {
        model: "m".into(),
        tenant: "default".into(),
    }
}

fn run(weights: CostWeights, seed: u64) {
    let eps = endpoints();
    // Door 1, ext_proc: the router over the pool's endpoints.
    let a = fleet(weights);
    let router = Router::kv_aware(a.kv.clone(), Saturation::in_flight(0));
    // Door 2, `kvepp serve`'s HTTP door: a pooled catalog over its own copy of the pool.
    let b = fleet(weights);
    let pool: Vec<Arc<Endpoint>> = eps
        .iter()
        .map(|e| Arc::new(Endpoint::new(e.addr, &*e.name)))
        .collect();
    let b_router = Arc::new(Router::kv_aware(b.kv.clone(), Saturation::in_flight(0)));
    let mut pooled = Catalog::pooled(b_router, Limits::default()).unwrap();
    pooled.set_pool(pool);
    // Door 3, the standalone selection service: the same workers registered over HTTP.
    let heard_c = Arc::new(Recorder::default());
    let mut standalone = Catalog::new(settings(weights), Limits::default());
    let l: Arc<dyn Listener> = heard_c.clone();
    standalone.set_listeners(Arc::new(move |_: &Scope| Some(l.clone())));
    for e in &eps {
        let w = Worker {
            worker_id: e.worker,
            block_size: BLOCK as u32,
            dp_start: 0,
            dp_size: 1,
            endpoint: Some(format!("http://{}", e.addr_str)),
            kv_events_endpoints: Default::default(),
            replay_endpoint: None,
        };
        standalone.register(scope(), w).unwrap();
    }
    let c = Fleet {
        kv: standalone.tracker(&scope()).unwrap().kv.clone(),
        heard: heard_c,
    };

    let mut rng = fastrand::Rng::with_seed(seed);
    let now = Instant::now();
    let mut live: Vec<(Booking, String, bool)> = Vec::new();
    let mut requests = 0;
    for step in 0..400u64 {
        match rng.u32(..10) {
            0..=4 => {
                let t = tokens(&mut rng);
                let hashes = sequence_hashes(&local_block_hashes(&t, BLOCK, None));
                let prompt = PromptRef {
                    hashes: &hashes,
                    isl_tokens: t.len() as u64,
                };
                let id = format!("r{step}");
                let facts = RequestFacts {
                    prompt: Prompt::TokenIds(t.clone()),
                    ..RequestFacts::default()
                };
                let mut ctx = PickContext::new(fastrand::Rng::with_seed(step), now);
                let d = router.route(facts, &eps, &mut ctx).unwrap();
                let reserve = Some((id.as_str(), now));
                let sb = pooled
                    .select(
                        &scope(),
                        prompt,
                        reserve,
                        &mut fastrand::Rng::with_seed(step),
                    )
                    .unwrap();
                let sc = standalone
                    .select(
                        &scope(),
                        prompt,
                        reserve,
                        &mut fastrand::Rng::with_seed(step),
                    )
                    .unwrap();
                let kv = d.pick.kv.unwrap();
                let picked = (d.pick.primary.worker, kv.effective_prefill_tokens);
                assert_eq!(
                    picked,
                    (sb.choice.rank.worker, sb.choice.effective_prefill_tokens),
                    "step {step}: ext_proc vs pooled HTTP"
                );
                assert_eq!(
                    picked,
                    (sc.choice.rank.worker, sc.choice.effective_prefill_tokens),
                    "step {step}: ext_proc vs standalone HTTP"
                );
                assert_eq!(kv.overlap, sb.choice.overlap, "step {step}");
                assert_eq!(kv.overlap, sc.choice.overlap, "step {step}");
                live.push((d.booking, id, false));
                requests += 1;
            }
            5 | 6 if !live.is_empty() => {
                let i = rng.usize(..live.len());
                let (booking, id, done) = &mut live[i];
                if !*done {
                    *done = true;
                    booking.first_byte();
                    pooled.prefill_complete(id).unwrap();
                    standalone.prefill_complete(id).unwrap();
                }
            }
            7 if !live.is_empty() => {
                let (booking, id, _) = live.swap_remove(rng.usize(..live.len()));
                drop(booking);
                assert!(pooled.free(&id), "step {step}");
                assert!(standalone.free(&id), "step {step}");
            }
            _ => {
                let t = tokens(&mut rng);
                let w = eps[rng.usize(..eps.len())].worker;
                let store = rng.u32(..4) != 0;
                for f in [&a, &b, &c] {
                    f.event(w, &t, store);
                }
            }
        }
        assert_eq!(a.loads(), b.loads(), "step {step}: loads, pooled HTTP");
        assert_eq!(a.loads(), c.loads(), "step {step}: loads, standalone HTTP");
    }
    assert!(requests > 100, "{requests} requests");
    let (ea, eb, ec) = (a.heard.events(), b.heard.events(), c.heard.events());
    assert!(ea.iter().any(|e| e.starts_with("free")), "{ea:?}");
    assert!(ea.iter().any(|e| e.starts_with("prefill")), "{ea:?}");
    assert_eq!(ea, eb, "replica-sync events, pooled HTTP");
    assert_eq!(ea, ec, "replica-sync events, standalone HTTP");
}

#[test]
fn every_door_picks_books_and_publishes_alike_under_dynamos_cost() {
    for seed in 0..3 {
        run(CostWeights::dynamo(), seed);
    }
}

#[test]
fn every_door_picks_books_and_publishes_alike_with_bounded_loads_and_predicted_ttft() {
    let bounded = CostWeights {
        load_bound: 1.0,
        ..CostWeights::dynamo()
    };
    run(bounded, 7);
    let ttft = CostWeights {
        cost_model: CostModel::PredictedTtft,
        ..CostWeights::dynamo()
    };
    run(ttft, 8);
    let hot = CostWeights {
        temperature: 0.5,
        ..CostWeights::dynamo()
    };
    run(hot, 9);
}
