//! Pod addresses that are local to the test: a real API server refuses loopback addresses in
//! EndpointSlices ("may not be in the loopback range"), and a test may send
//! traffic only to addresses of its own. So a test that routes to pods runs in a network namespace
//! of its own, made for it by `unshare --net`, whose loopback interface is up and also holds
//! [`POD_CIDR`]: every address in it is local, nothing leaves the namespace, and pods listen on
//! their own address and port as they do in a cluster.
//!
//! [`run`] re-executes the calling test inside such a namespace (the test binary with `--exact`
//! and the test's name) and passes or fails with it; inside, it runs the test's body on a tokio
//! runtime. Everything the body starts (the API server, kvepp, Envoy, engines) inherits the
//! namespace.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The addresses pods get: 10.244.0.0/16, local inside the namespace.
pub const POD_CIDR: &str = "10.244.0.0/16";
/// The namespace's own first address, with the prefix that makes the whole range local.
const GATEWAY: &str = "10.244.0.1/16";
/// A kubeconfig with cluster-admin rights on a cluster of your own: when set, the tests run
/// against that cluster instead of starting etcd and kube-apiserver (see docs/operations.md), and
/// outside any pod network (which could not reach it); what needs the local API server (a
/// restart, a compaction, a token it signed, pods on the pod network) says so.
pub const EXTERNAL: &str = "KVEPP_TEST_KUBECONFIG";
/// Set (to the test's name) in the re-executed test: its body runs.
const INSIDE: &str = "KVEPP_POD_NETWORK_TEST";
/// How long one test may run inside its namespace.
const TEST_DEADLINE: Duration = Duration::from_secs(600);

/// Pod `n`'s address: 10.244.0.2, 10.244.0.3, … (250 a /24).
pub fn pod_ip(n: usize) -> IpAddr {
    let (hi, lo) = (n / 250, n % 250 + 2);
    IpAddr::V4(Ipv4Addr::new(10, 244, hi as u8, lo as u8))
}

/// Runs `body` in a network namespace of its own (see the module doc). `test` is the calling
/// test's name as libtest lists it (the function's path inside the test binary).
pub fn run<F, Fut>(test: &str, body: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = ()>,
{
    // Inside the namespace, or against an external cluster (which the namespace could not reach):
    // the body runs here.
    let external = cfg!(feature = "kube") && std::env::var_os(EXTERNAL).is_some();
    if std::env::var(INSIDE).as_deref() == Ok(test) || external {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        rt.block_on(body());
        return;
    }
    let dir = crate::TempDir::new("pod-network");
    let log_path = dir.path().join("test.log");
    let log = std::fs::File::create(&log_path).expect("log file");
    let exe = std::env::current_exe().expect("the test binary");
    let setup = format!(
        "PATH=\"$PATH:/usr/sbin:/sbin\"; ip link set lo up && ip addr add {GATEWAY} dev lo && exec \"$0\" \"$@\""
    );
    let mut unshare = Command::new("unshare");
    unshare.arg("--net");
    if !is_root() {
        unshare.arg("--map-root-user");
    }
    let mut child = unshare
        .args(["--", "sh", "-c", &setup])
        .arg(&exe)
        .args([test, "--exact", "--nocapture", "--test-threads", "1"])
        .env(INSIDE, test)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log file"))
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("unshare: {e}: util-linux's unshare runs the pod network"));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the test") {
            break status;
        }
        if start.elapsed() > TEST_DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{test} ran past {TEST_DEADLINE:?} in its pod network:\n{}",
                tail(&log_path)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        status.success(),
        "{test} failed in its pod network ({status}):\n{}",
        tail(&log_path)
    );
    assert!(
        text.contains("test result: ok. 1 passed"),
        "{test} did not run in its pod network (is the name right?):\n{}",
        tail(&log_path)
    );
    // Captured by libtest: shown with --nocapture or when a later assertion fails.
    eprintln!("{}", tail(&log_path));
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.starts_with(b"0\n"))
        .unwrap_or(false)
}

/// The last 200 lines of a log.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(200)..].join("\n")
}
