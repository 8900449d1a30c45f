//! A rolling upgrade under load (`kvepp-bench bench-rollout`, small): two `kvepp serve` processes
//! behind a real Envoy with the shipped bootstrap (fail-close, health-checked ext_proc cluster),
//! each restarted twice, one after the other, by SIGTERM: no request fails, and the prefix hit
//! ratio after the rollout is that of before (each replacement recovered the index from its peer).

use std::path::PathBuf;

use kvepp_bench::rollout::{rollout, table, RolloutArgs};

/// The `kvepp` binary cargo built beside this test (`target/<profile>/kvepp`).
fn kvepp_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .unwrap()
        .join("kvepp");
    assert!(
        bin.exists(),
        "{} not built: run the workspace's tests (scripts/test.sh) or `cargo build` first",
        bin.display()
    );
    bin
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_upgrade_under_load_fails_no_request_and_keeps_the_hit_ratio() {
    let args = RolloutArgs {
        envoy: kvepp_test_support::harness::envoy_bin(),
        kvepp: kvepp_bin(),
        engines: 2,
        rate: 10.0,
        warmup_seconds: 3,
        window_seconds: 5,
        rounds: 2,
        shutdown_delay_ms: 3000,
        groups: 4,
        seed: 3,
        out: None,
    };
    let dir = kvepp_test_support::TempDir::new("rollout-test");
    let r = rollout(&args, dir.path()).await.unwrap();
    let text = table(&args, &r);
    println!("{text}");
    assert_eq!(r.restarts.len(), 4, "{text}");
    assert!(r.during.requests > 0, "load kept flowing: {text}");
    assert_eq!(r.failed, 0, "{text}");
    assert!(r.before.hit_ratio > 0.5, "{text}");
    assert!(
        (r.after.hit_ratio - r.before.hit_ratio).abs() <= 0.05,
        "{text}"
    );
}
