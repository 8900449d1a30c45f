//! The `kvepp` binary as a user runs it: configuration precedence and validation, gRPC health,
//! metrics, and graceful shutdown on SIGTERM with a stream still open.

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Command, Stdio};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request as Req, processing_response::Response as Resp, HttpBody,
    HttpHeaders, ProcessingRequest, ProtocolConfiguration,
};
use kvepp_test_support::prelude::*;
use kvepp_test_support::TempDir;
use tokio_stream::wrappers::ReceiverStream;

const BIN: &str = env!("CARGO_BIN_EXE_kvepp");

#[test]
fn invalid_configuration_names_every_bad_field() {
    let out = Command::new(BIN)
        .args([
            "serve",
            "--pool-name",
            "Bad_Name",
            "--manifests-dir",
            "/nonexistent/dir",
            "--bind-address",
            "not-an-ip",
            "--max-body-bytes",
            "5",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    for field in [
        "bind_address",
        "pool_name",
        "manifests_dir",
        "max_body_bytes",
    ] {
        assert!(
            err.contains(&format!("{field}: ")),
            "{field} missing from:\n{err}"
        );
    }
}

#[test]
fn config_precedence_file_env_flag() {
    let dir = TempDir::new("bin-config");
    let file = dir.path().join("kvepp.yaml");
    std::fs::write(&file, format!("pool_name: from-file\nmanifests_dir: {}\ngrpc_port: 1111\nmetrics_port: 2222\nmax_in_flight_per_endpoint: 7\n", dir.path().display())).unwrap();
    let out = Command::new(BIN)
        .args(["config", "--config"])
        .arg(&file)
        .args(["--grpc-port", "3333"])
        .env("KVEPP_METRICS_PORT", "4444")
        .env("KVEPP_GRPC_PORT", "5555")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cfg: serde_yaml::Value = serde_yaml::from_slice(&out.stdout).unwrap();
    assert_eq!(cfg["pool_name"], "from-file");
    assert_eq!(cfg["grpc_port"], 3333, "flag beats env and file");
    assert_eq!(cfg["metrics_port"], 4444, "env beats file");
    assert_eq!(cfg["max_in_flight_per_endpoint"], 7, "file beats default");
    assert_eq!(cfg["grpc_health_port"], 9003, "default");
}

#[tokio::test]
async fn serves_health_and_metrics_and_drains_on_sigterm() {
    let dir = TempDir::new("bin");
    std::fs::write(
        dir.path().join("pool.yaml"),
        pool_yaml("pool")
            + &standard_models()
            + &slice_yaml("s", "10.0.0.1:8000".parse().unwrap(), true),
    )
    .unwrap();
    let (grpc, health, metrics) = (free_port(), free_port(), free_port());
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--pool-name",
            "pool",
            "--bind-address",
            "127.0.0.1",
            "--log-format",
            "json",
        ])
        .arg("--manifests-dir")
        .arg(dir.path())
        .args([
            "--grpc-port",
            &grpc.to_string(),
            "--grpc-health-port",
            &health.to_string(),
            "--metrics-port",
            &metrics.to_string(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    kvepp_test_support::epp::wait_health_serving(health).await;
    let metrics_addr: SocketAddr = ([127, 0, 0, 1], metrics).into();
    let text = String::from_utf8(
        http(metrics_addr, "GET", "/metrics", &[], "")
            .await
            .body
            .to_vec(),
    )
    .unwrap();
    for name in [
        "kvepp_ready_endpoints 1",
        "# TYPE kvepp_pick_duration_seconds histogram",
        "kvepp_build_info{version=",
        "kvepp_in_flight_requests 0",
    ] {
        assert!(text.contains(name), "{name} not in\n{text}");
    }

    // A request is mid-body when SIGTERM arrives: it must still be answered.
    let mut client = ExternalProcessorClient::connect(format!("http://127.0.0.1:{grpc}"))
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut inbound = client
        .process(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    tx.send(ProcessingRequest {
        request: Some(Req::RequestHeaders(HttpHeaders::default())),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: 4,
            ..Default::default()
        }),
        ..Default::default()
    })
    .await
    .unwrap();
    tx.send(ProcessingRequest {
        request: Some(Req::RequestBody(HttpBody {
            body: br#"{"model":"#.to_vec(),
            ..Default::default()
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    // New connections are refused once the listeners close …
    wait_for("ext_proc listener closed", || async move {
        tokio::net::TcpStream::connect(("127.0.0.1", grpc))
            .await
            .is_err()
            .then_some(())
    })
    .await;
    // … while the open stream finishes.
    tx.send(ProcessingRequest {
        request: Some(Req::RequestBody(HttpBody {
            body: br#""m"}"#.to_vec(),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    let answer = tokio::time::timeout(DEADLINE, inbound.message())
        .await
        .expect("in time")
        .expect("ok")
        .expect("answer");
    assert!(
        matches!(answer.response, Some(Resp::RequestHeaders(_))),
        "{answer:?}"
    );
    drop(tx);
    drop(inbound);
    drop(client);
    let exit = wait_for("kvepp exits", || {
        let r = child.try_wait().unwrap();
        async move { r }
    })
    .await;
    let mut log = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(exit.success(), "exit {exit:?}\n{log}");
    assert!(
        log.contains("SIGTERM received") && log.contains("shutdown complete"),
        "{log}"
    );
    assert!(
        log.contains("\"configuration\""),
        "configuration logged once at startup:\n{log}"
    );
}

/// The shipped binaries need only the C runtime: a minimal container image (no fontconfig,
/// freetype, libpng, OpenSSL) runs them. `ldd` lists every shared library a binary loads.
#[test]
fn shipped_binaries_link_only_the_c_runtime() {
    const C_RUNTIME: [&str; 5] = [
        "linux-vdso",
        "libc.so",
        "libm.so",
        "libgcc_s.so",
        "ld-linux",
    ];
    for bin in [BIN, env!("CARGO_BIN_EXE_kvepp-agent")] {
        let out = std::process::Command::new("ldd")
            .arg(bin)
            .output()
            .expect("ldd runs");
        assert!(out.status.success(), "ldd {bin} failed");
        let text = String::from_utf8_lossy(&out.stdout);
        let libs: Vec<&str> = text
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        assert!(libs.iter().any(|l| l.starts_with("libc.so")), "{text}");
        let extra: Vec<&&str> = libs
            .iter()
            .filter(|l| !C_RUNTIME.iter().any(|c| l.contains(c)))
            .collect();
        assert!(
            extra.is_empty(),
            "{bin} links {extra:?} beyond the C runtime:\n{text}"
        );
    }
}

/// `kvepp select-service` and `kvepp slot-tracker` take exactly their documented flags, with their
/// defaults, and refuse bad ones with a message naming the flag.
#[test]
fn http_services_take_their_documented_flags() {
    let help = |sub: &str| {
        let out = Command::new(BIN).args([sub, "--help"]).output().unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    let select = help("select-service");
    for flag in [
        "--port <PORT>",
        "--threads <THREADS>",
        "--indexer-peers",
        "--replica-sync-port",
        "--replica-sync-peers",
    ] {
        assert!(select.contains(flag), "select-service {flag}:\n{select}");
    }
    assert!(select.contains("[default: 8092]") && select.contains("[default: 4]"));
    let slots = help("slot-tracker");
    for flag in [
        "--port <PORT>",
        "--replica-sync-bind",
        "--replica-sync-advertise",
        "--replica-sync-peers",
    ] {
        assert!(slots.contains(flag), "slot-tracker {flag}:\n{slots}");
    }
    assert!(slots.contains("[default: 8091]"));

    let refused = |args: &[&str], names: &str| {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} refused");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(names), "{args:?}: {err}");
    };
    refused(
        &["select-service", "--replica-sync-peers", "tcp://b:9092"],
        "--replica-sync-port",
    );
    refused(
        &[
            "select-service",
            "--port",
            "0",
            "--indexer-peers",
            "ftp://x",
        ],
        "--indexer-peers",
    );
    refused(
        &[
            "slot-tracker",
            "--port",
            "0",
            "--replica-sync-peers",
            "tcp://b:1",
        ],
        "--replica-sync-bind",
    );
    refused(
        &[
            "slot-tracker",
            "--port",
            "0",
            "--replica-sync-bind",
            "tcp://*:1",
            "--replica-sync-peers",
            "udp://b",
        ],
        "--replica-sync-peers",
    );
}

#[test]
fn worker_agent_exits_naming_the_topology_file_that_never_appeared() {
    let dir = TempDir::new("agent-topology");
    std::fs::write(dir.path().join("rack"), "r1").unwrap();
    let out = Command::new(BIN)
        .args([
            "worker-agent",
            "--component",
            "pool",
            "--registry",
            "manifests",
            "--manifests-dir",
        ])
        .arg(dir.path())
        .arg("--topology-dir")
        .arg(dir.path())
        .args(["--listen", "127.0.0.1:0", "--topology-wait-seconds", "0"])
        .env("DYN_TOPOLOGY_ENABLED", "true")
        .env("DYN_ROUTER_KV_TRANSFER_TOPOLOGY_LEVEL", "zone")
        .output()
        .unwrap();
    assert!(!out.status.success(), "must exit non-zero");
    let err = String::from_utf8_lossy(&out.stderr);
    let file = dir.path().join("zone").display().to_string();
    assert!(err.contains(&file), "the message names {file}:\n{err}");
    assert!(err.contains("DYN_TOPOLOGY_ENABLED"), "{err}");
}

/// The worker-agent reads its flags from the configuration tree's `worker_agent` section (the
/// same file as `kvepp serve`'s), under the environment and the command line.
#[test]
fn worker_agent_takes_its_flags_from_the_config_file() {
    let dir = TempDir::new("agent-config");
    let file = dir.path().join("kvepp.yaml");
    std::fs::write(
        &file,
        format!(
            "pool_name: pool\nworker_agent:\n  component: pool\n  registry: manifests\n  manifests_dir: {d}\n  topology_dir: {d}\n  topology_enabled: true\n  topology_level: rack\n  topology_wait_seconds: 0\n  listen: 127.0.0.1:0\n",
            d = dir.path().display()
        ),
    )
    .unwrap();
    let run = |extra: &[&str]| {
        let out = Command::new(BIN)
            .args(["worker-agent", "--config"])
            .arg(&file)
            .args(extra)
            .env_remove("DYN_TOPOLOGY_ENABLED")
            .env_remove("DYN_ROUTER_KV_TRANSFER_TOPOLOGY_LEVEL")
            .output()
            .unwrap();
        assert!(!out.status.success(), "must exit non-zero");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // Everything from the file: it waits for the file's level and names it.
    let err = run(&[]);
    let rack = dir.path().join("rack").display().to_string();
    assert!(err.contains(&rack), "the file's level, {rack}:\n{err}");
    // A flag overrides the file.
    let err = run(&["--topology-level", "zone"]);
    let zone = dir.path().join("zone").display().to_string();
    assert!(err.contains(&zone), "the flag's level, {zone}:\n{err}");
    // A key that is no flag is refused, naming it.
    std::fs::write(&file, "worker_agent: {no_such_flag: 1}\n").unwrap();
    let err = run(&[]);
    assert!(err.contains("no_such_flag"), "{err}");
}

#[test]
fn dynamo_topology_variables_reach_the_router_config() {
    let bad = Command::new(BIN)
        .args(["serve", "--pool-name", "p", "--manifests-dir"])
        .arg(std::env::temp_dir())
        .env("DYN_ROUTER_KV_TRANSFER_MISMATCH_POLICY", "sometimes")
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains(
            "DYN_ROUTER_KV_TRANSFER_MISMATCH_POLICY: \"sometimes\" is not fail or fallback"
        ),
        "{err}"
    );
}
