//! The peers beside kvepp, on the same API server, pods and Envoy: the Gateway API Inference
//! Extension's reference EPP (built at a pinned version by `scripts/install-peers.sh`) discovers
//! the pool kvepp's tests use and routes real requests.

use super::*;

/// The reference EPP's binary: `REFERENCE_EPP_BIN`, else what `scripts/install-peers.sh` builds.
fn reference_epp_bin() -> PathBuf {
    let [bin] = kube_cluster::installed("install-peers.sh", ["REFERENCE_EPP_BIN"]);
    bin
}

/// A peer's process, killed on drop, its log in a file.
struct Peer {
    child: Child,
    log: PathBuf,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The reference EPP, watching InferencePool `pool` and its Pods through the cluster's admin
/// kubeconfig, serving ext_proc over TLS with its self-signed certificate as the shipped Envoy
/// configuration expects (its default, as kvepp's), routes requests from Envoy to every
/// ready pod of the pool (round robin, the reference's policy), and to none that is not ready.
#[test]
fn the_reference_epp_routes_from_the_same_api_server() {
    in_pod_network!(
        the_reference_epp_routes_from_the_same_api_server,
        reference_epp
    );
}

async fn reference_epp() {
    let cluster = KubeCluster::start().await;
    let names = ["pod-a", "pod-b", "pod-c"];
    let _pods = Pods::start(&names).await;
    cluster.put(POOLS_V1, pool_v1("pool", 8000)).await;
    for (n, name) in names.iter().enumerate() {
        cluster.put(PODS, pod(name)).await;
        cluster
            .patch_status(PODS, name, pod_status(pod_ip(n), *name != "pod-c"))
            .await;
    }
    let dir = TempDir::new("reference-epp");
    let log = dir.path().join("reference-epp.log");
    let grpc: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let peer = Peer {
        child: Command::new(reference_epp_bin())
            .args(["--pool-name", "pool", "--pool-namespace", "default"])
            .args(["--grpc-port", &grpc.port().to_string()])
            .args(["--grpc-health-port", &free_port().to_string()])
            .args(["--metrics-port", &free_port().to_string()])
            .env("KUBECONFIG", cluster.kubeconfig(dir.path()))
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(dir.path().join("stderr.log")).unwrap())
            .spawn()
            .unwrap(),
        log,
    };
    let envoy = Envoy::start(bootstrap(), grpc).await;
    let last = std::sync::Mutex::new(None);
    let seen = kvepp_test_support::wait_until(
        "the reference EPP routes to both ready pods",
        BACKOFF_DEADLINE,
        || async {
            let (seen, codes, _) = served_by(&envoy, "chat", 6).await;
            let ok = codes == [200; 6] && seen.len() == 2;
            *last.lock().unwrap() = Some((seen.clone(), codes));
            ok.then_some(seen)
        },
    )
    .await
    .unwrap_or_else(|e| {
        let log = std::fs::read_to_string(&peer.log).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        panic!(
            "{e}; last answers {:?}\n{}\n{}",
            last.lock().unwrap(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
            envoy.log()
        )
    });
    assert_eq!(
        seen,
        set(&["pod-a", "pod-b"]),
        "the unready pod-c takes nothing"
    );
}
