//! SGLang endpoints beside vLLM's in one pool. SGLang does not run here (its kernels need CUDA);
//! its router-facing code does: `tests/fixtures/sglang/peer.py` serves SGLang's own metrics
//! collector's page and publishes through SGLang's own KV-event recorder and `ZmqEventPublisher`
//! (array batches, signed hashes, merged page-aligned stores, `medium`, a replay reply with its
//! topic frame), loaded from the sglang wheel (`scripts/install-sglang-peer.sh`).

use std::net::SocketAddr;
use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::*;

/// One SGLang peer process (ends when its standard input closes, i.e. when dropped).
struct SglangPeer {
    child: Child,
    target: Target,
}

impl SglangPeer {
    async fn start(install: &VllmInstall, name: &str) -> SglangPeer {
        let target = Target {
            name: name.into(),
            http: SocketAddr::from(([127, 0, 0, 1], free_port())),
            events_port: free_port(),
            replay_port: free_port(),
        };
        Self::launch(install, target).await
    }

    async fn launch(install: &VllmInstall, target: Target) -> SglangPeer {
        let wheel = repo_root().join(".venv/sglang-wheel");
        assert!(
            wheel.join("sglang").exists(),
            "{} missing: run scripts/install-sglang-peer.sh (scripts/test.sh does)",
            wheel.display()
        );
        let mut child = Command::new(&install.python)
            .arg(repo_root().join("tests/fixtures/sglang/peer.py"))
            .arg(&wheel)
            .args(["--port", &target.http.port().to_string()])
            .args(["--events-port", &target.events_port.to_string()])
            .args(["--replay-port", &target.replay_port.to_string()])
            .args(["--name", &target.name])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("sglang peer");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let ready = tokio::time::timeout(DEADLINE, lines.next_line())
            .await
            .expect("the SGLang peer starts in time")
            .expect("read");
        assert_eq!(ready.as_deref(), Some("ready"));
        SglangPeer { child, target }
    }

    /// Stops the peer and starts it again on the same ports (a new publisher, an empty cache).
    async fn restart(self, install: &VllmInstall) -> SglangPeer {
        let SglangPeer { mut child, target } = self;
        drop(child.stdin.take());
        let _ = child.wait().await;
        Self::launch(install, target).await
    }

    /// Sets the load SGLang's collector reports.
    async fn set_load(&self, running: u32, queued: u32, token_usage: f64) {
        let body =
            serde_json::json!({"running": running, "queued": queued, "token_usage": token_usage});
        let r = http(self.target.http, "POST", "/load", &[], body.to_string()).await;
        assert_eq!(r.status, 200);
    }

    /// A prompt sent straight to the peer (its cache then holds the prompt's pages).
    async fn take(&self, ids: &[u32]) {
        let body = serde_json::json!({"model": "m", "prompt": ids});
        let r = post_json(self.target.http, body.to_string()).await;
        assert_eq!(r.status, 200);
    }
}

/// Waits until kvepp's index for `addr` holds exactly what the publisher at `replay_port` says.
async fn until_index_matches(epp: &Epp, addr: SocketAddr, replay_port: u16) -> EngineBlocks {
    kvepp_test_support::wait_until(
        "kvepp's index equal to SGLang's events",
        DEADLINE,
        || async {
            let t = published_blocks(replay_port).await;
            let (_, k) = kvepp_blocks(epp, addr).await;
            (k == t.held && !k.is_empty()).then_some(t)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_and_vllm_endpoints_are_routed_by_one_kvepp() {
    let fleet = fleet();
    let peer = SglangPeer::start(&fleet.install, "sglang-0").await;
    let vllm = &fleet.engines[0];
    let targets = [Target::from(vllm), peer.target.clone()];
    // Dynamo's cost (overlap and load): the peer answers at once, and a cost that learns each
    // engine's speed would rightly prefer it to the CPU engine whatever either holds.
    let d = deploy_targets(&fleet.install, &targets, |c| {
        c.router.cost_model = kvepp_core::cost::CostModel::Dynamo;
    })
    .await;
    for (addr, kind) in [(vllm.http, "vllm"), (peer.target.http, "sglang")] {
        let series = format!("kvepp_engine_kind{{endpoint=\"{addr}\",engine=\"{kind}\"}}");
        wait_for("the engine kind read from its metrics page", || {
            let s = series.clone();
            let epp = &d.epp;
            async move { (epp.metric(&s).await? == 1.0).then_some(()) }
        })
        .await;
    }
    // SGLang's page size (32) is the pool's block size; its held pages are kvepp's blocks.
    let on_sglang = id_prompt(7001, 16);
    let on_vllm = id_prompt(7002, 16);
    peer.take(&on_sglang).await;
    let r = post_json(
        vllm.http,
        completion("m", on_vllm.clone().into(), 1).to_string(),
    )
    .await;
    assert_eq!(r.status, 200);
    let held = until_index_matches(&d.epp, peer.target.http, peer.target.replay_port).await;
    assert!(
        held.held.len() >= 16,
        "the peer's 16 pages: {}",
        held.held.len()
    );
    let (bs, _) = kvepp_blocks(&d.epp, vllm.http).await;
    assert_eq!(bs, 32);
    // Each prompt goes where its prefix is cached, whichever engine that is.
    let extend = |p: &[u32], seed: u32| {
        let mut p = p.to_vec();
        p.extend(id_prompt(seed, 2));
        p
    };
    let vllm_blocks = kvepp_core::hash::sequence_hashes(&local_block_hashes(&on_vllm, BLOCK, None));
    wait_for("the vLLM engine's blocks of its prompt indexed", || async {
        let (_, k) = kvepp_blocks(&d.epp, vllm.http).await;
        vllm_blocks.iter().all(|h| k.contains(h)).then_some(())
    })
    .await;
    for i in 0..3 {
        let r = send(
            &d.envoy,
            "/v1/completions",
            completion("m", extend(&on_sglang, 7100 + i).into(), 1),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.engine, Some(peer.target.http), "SGLang holds this prefix");
        let r = send(
            &d.envoy,
            "/v1/completions",
            completion("m", extend(&on_vllm, 7200 + i).into(), 1),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.engine, Some(vllm.http), "vLLM holds this prefix");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_sglang_publisher_has_its_part_of_the_index_rebuilt_and_its_queue_saturates() {
    let fleet = fleet();
    let peer = SglangPeer::start(&fleet.install, "sglang-1").await;
    let d = deploy_targets(&fleet.install, std::slice::from_ref(&peer.target), |_| {}).await;
    let before = id_prompt(8001, 12);
    peer.take(&before).await;
    let first = until_index_matches(&d.epp, peer.target.http, peer.target.replay_port).await;
    assert_eq!(first.held.len(), 12);
    // A new publisher (sequence numbers from 0 again) with an empty cache.
    let peer = peer.restart(&fleet.install).await;
    let after = id_prompt(8002, 5);
    peer.take(&after).await;
    let rebuilt = until_index_matches(&d.epp, peer.target.http, peer.target.replay_port).await;
    assert_eq!(
        rebuilt.held.len(),
        5,
        "only what the restarted engine holds: the old blocks dropped, never mixed in"
    );
    assert!(rebuilt.held.is_disjoint(&first.held));
    // SGLang's own queue (`sglang:num_queue_reqs` past the threshold of 5) saturates the pool's
    // only engine: a Sheddable request gets 429, and is served again once the queue drains.
    let shed = || completion("shed", id_prompt(8003, 2).into(), 1);
    peer.set_load(8, 10, 0.5).await;
    wait_for(
        "a sheddable request refused by the queueing SGLang engine",
        || async { (send(&d.envoy, "/v1/completions", shed()).await.status == 429).then_some(()) },
    )
    .await;
    peer.set_load(0, 0, 0.1).await;
    wait_for(
        "the drained SGLang engine serving sheddable requests",
        || async { (send(&d.envoy, "/v1/completions", shed()).await.status == 200).then_some(()) },
    )
    .await;
}
