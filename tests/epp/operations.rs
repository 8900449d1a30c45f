//! Running kvepp for months: the `kvepp` binary behind a real Envoy reloads its configuration
//! (a watched `--config` file replaced the way a Kubernetes ConfigMap mount replaces it, and
//! SIGHUP) and rotates its TLS certificate under steady load, with no failed request and no
//! restart; and it exports a span per decision over OTLP to a wire-level receiver, joined to the
//! request's trace and propagated to the engine.

use kvepp_test_support::otlp;
use kvepp_test_support::tls;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use kvepp_test_support::client::fetch;
use kvepp_test_support::prelude::*;
use kvepp_test_support::{find_sample, TempDir};
use tls::*;
use tokio::process::Command;
use tokio::sync::watch;
use tonic::transport::{Certificate, ClientTlsConfig};

const BIN: &str = env!("CARGO_BIN_EXE_kvepp");

/// `kvepp` with `args` and `env`, its stderr in `log`.
fn spawn_kvepp(
    args: &[&std::ffi::OsStr],
    env: &[(&str, String)],
    log: &Path,
) -> tokio::process::Child {
    Command::new(BIN)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// Whether kvepp's `/ready` on `admin` answers 200 now.
async fn is_ready(admin: SocketAddr) -> bool {
    matches!(fetch(admin, "/ready").await, Ok((200, _)))
}

/// Waits for kvepp's `/ready` on `admin`.
async fn ready(admin: SocketAddr) {
    wait_for("kvepp ready", || async move {
        is_ready(admin).await.then_some(())
    })
    .await;
}

/// A manifests directory under `root` with the pool, its models and one slice per backend.
fn manifests_dir(root: &Path, backends: &[SocketAddr]) -> PathBuf {
    let dir = root.join("manifests");
    std::fs::create_dir_all(&dir).unwrap();
    let mut text = pool_yaml("pool") + &standard_models();
    for (i, b) in backends.iter().enumerate() {
        text += &slice_yaml(&format!("s{i}"), *b, true);
    }
    std::fs::write(dir.join("pool.yaml"), text).unwrap();
    dir
}

/// Replaces `link` with a symlink to `target` in one step, as the kubelet swaps a ConfigMap's
/// `..data` link.
fn swap_link(link: &Path, target: &Path) {
    let tmp = link.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp).unwrap();
    std::fs::rename(&tmp, link).unwrap();
}

/// Writes `text` to `path` in one step (a temporary file renamed over it).
fn replace_file(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

async fn metric(addr: SocketAddr, series: &str) -> f64 {
    let (_, text) = fetch(addr, "/metrics").await.unwrap();
    find_sample(&text, series).unwrap_or(0.0)
}

async fn config_version(addr: SocketAddr) -> (u64, serde_json::Value) {
    let (status, body) = fetch(addr, "/debug/config").await.unwrap();
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    (v["version"].as_u64().unwrap(), v["config"].clone())
}

async fn wait_version(addr: SocketAddr, want: u64) -> serde_json::Value {
    wait_for("configuration version", || async move {
        let (v, cfg) = config_version(addr).await;
        (v == want).then_some(cfg)
    })
    .await
}

/// The backend that answered `prompt` for model `model`, with its status.
async fn probe(envoy: SocketAddr, model: &str, prompt: &str) -> (u16, String) {
    let r = post_json(
        envoy,
        serde_json::json!({"model": model, "prompt": prompt}).to_string(),
    )
    .await;
    let backend = if r.status == 200 {
        r.json()["backend"].as_str().unwrap_or("").to_owned()
    } else {
        String::new()
    };
    (r.status, backend)
}

/// How many of 20 repeats of a long prompt went to the endpoint its first copy went to.
async fn repeats_at_home(envoy: SocketAddr, prompt: &str) -> usize {
    let (status, home) = probe(envoy, "m", prompt).await;
    assert_eq!(status, 200);
    let mut at_home = 0;
    for _ in 0..20 {
        let (status, b) = probe(envoy, "m", prompt).await;
        assert_eq!(status, 200);
        at_home += usize::from(b == home);
    }
    at_home
}

struct Files {
    real: PathBuf,
    link: PathBuf,
    base: String,
}

impl Files {
    /// A version of the configuration: the base plus `extra`, under `real/<name>.yaml`.
    fn version(&self, name: &str, extra: &str) -> PathBuf {
        let p = self.real.join(format!("{name}.yaml"));
        std::fs::write(&p, format!("{}{extra}", self.base)).unwrap();
        p
    }
}

#[tokio::test]
async fn reload_and_certificate_rotation_under_load_lose_no_request() {
    let backends = echo_backends(&["a", "b"]).await;
    let dir = TempDir::new("reload");
    let root = dir.path();
    let manifests = manifests_dir(root, &backends);
    // Two CAs: the server certificate is first signed by one, then rotated to the other's.
    let (tls, first, second) = (root.join("tls"), root.join("pki1"), root.join("pki2"));
    for d in [&tls, &first, &second] {
        std::fs::create_dir_all(d).unwrap();
    }
    let (pki1, pki2) = (write_pki(&first), write_pki(&second));
    for f in ["server.pem", "server-key.pem"] {
        std::fs::copy(first.join(f), tls.join(f)).unwrap();
    }
    let (grpc, health, metrics) = (free_port(), free_port(), free_port());
    let base = format!(
        "pool_name: pool\nmanifests_dir: {}\nmanifests_poll_ms: 20\nbind_address: 127.0.0.1\n\
         grpc_port: {grpc}\ngrpc_health_port: {health}\nmetrics_port: {metrics}\n\
         shutdown_grace_seconds: 1\n\
         grpc_tls: {{mode: files, cert_file: {}, key_file: {}, accept_plaintext: true}}\n\
         router: {{cost_model: dynamo}}\n",
        manifests.display(),
        tls.join("server.pem").display(),
        tls.join("server-key.pem").display(),
    );
    // The file kvepp is given is a symlink in its own directory (a ConfigMap mount's shape).
    let files = Files {
        real: root.join("real"),
        link: root.join("conf").join("kvepp.yaml"),
        base,
    };
    std::fs::create_dir_all(&files.real).unwrap();
    std::fs::create_dir_all(files.link.parent().unwrap()).unwrap();
    swap_link(&files.link, &files.version("v1", ""));
    let log_path = root.join("kvepp.log");
    let mut child = spawn_kvepp(
        &[
            "serve".as_ref(),
            "--config".as_ref(),
            files.link.as_os_str(),
        ],
        &[],
        &log_path,
    );
    let pid = child.id();
    let admin: SocketAddr = ([127, 0, 0, 1], metrics).into();
    let ext_proc: SocketAddr = ([127, 0, 0, 1], grpc).into();
    ready(admin).await;
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let envoy = Envoy::start(bootstrap(), ext_proc).await;
    let (stop_tx, stop) = watch::channel(false);
    let (outcomes, clients) = steady_load(envoy.addr, 3, stop);
    wait_for("load flowing", || {
        let n = count(&outcomes, |_| true);
        async move { (n > 20).then_some(()) }
    })
    .await;
    assert_eq!(config_version(admin).await.0, 1);

    // 1. The file replaced (symlink swap): an unknown model is routed instead of 404.
    assert_eq!(probe(envoy.addr, "nope", "x").await.0, 404);
    swap_link(
        &files.link,
        &files.version("v2", "unknown_models: pass-through\n"),
    );
    let cfg = wait_version(admin, 2).await;
    assert_eq!(cfg["unknown_models"], "pass-through");
    assert_eq!(probe(envoy.addr, "nope", "x").await.0, 200);

    // 2. SIGHUP after an edit the watch does not see (the link's target changed in place): the
    // cost weights change. Under Dynamo's cost (where the credit is the only thing that tells the
    // two endpoints apart for a repeated prompt; the predicted costs also weigh what they learned
    // of each) with the overlap credited, every repeat of a long prompt goes where its prefix is;
    // with no credit for it, load and chance spread them.
    let long = "the same long system prompt, many blocks of it. ".repeat(40);
    assert_eq!(repeats_at_home(envoy.addr, &long).await, 20);
    std::fs::write(
        files.real.join("v2.yaml"),
        format!(
            "{}unknown_models: pass-through\n",
            files.base.replace(
                "router: {cost_model: dynamo}",
                "router: {cost_model: dynamo, kv_overlap_score_credit: 0.0}"
            )
        ),
    )
    .unwrap();
    let hup = std::process::Command::new("kill")
        .args(["-HUP", &pid.unwrap().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    let cfg = wait_version(admin, 3).await;
    assert_eq!(cfg["router"]["kv_overlap_score_credit"], 0.0);
    let other = "another long system prompt, many blocks of it too. ".repeat(40);
    assert!(
        repeats_at_home(envoy.addr, &other).await < 20,
        "the overlap is still credited after the reload"
    );

    // 3. The certificate rotated (before flow control: a saturated pool would queue the probe,
    // whose client half-closes at once): the next TLS connection gets the new one.
    let trust = |ca: &str| ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
    over_tls(ext_proc, trust(&pki1.ca)).await.unwrap();
    assert!(over_tls(ext_proc, trust(&pki2.ca)).await.is_err());
    let tls_applied = "kvepp_tls_reloads_total{result=\"applied\"}";
    // Key first, then certificate: until both are in, the pair may not match and is refused.
    for f in ["server-key.pem", "server.pem"] {
        replace_file(
            &tls.join(f),
            &std::fs::read_to_string(second.join(f)).unwrap(),
        );
    }
    wait_for("rotated certificate served", || {
        let ca = pki2.ca.clone();
        async move { over_tls(ext_proc, trust(&ca)).await.ok() }
    })
    .await;
    // The counter moves just after the new material is in: wait for it too.
    wait_for("rotation counted", || async move {
        (metric(admin, tls_applied).await >= 1.0).then_some(())
    })
    .await;
    assert!(over_tls(ext_proc, trust(&pki1.ca)).await.is_err());
    // A certificate that does not load: the rotated one keeps serving.
    let tls_rejected = "kvepp_tls_reloads_total{result=\"rejected\"}";
    let before = metric(admin, tls_rejected).await;
    replace_file(&tls.join("server.pem"), "not a certificate\n");
    wait_for("bad certificate counted", || async move {
        (metric(admin, tls_rejected).await > before).then_some(())
    })
    .await;
    over_tls(ext_proc, trust(&pki2.ca)).await.unwrap();

    // 4. Flow control turned on with one request per endpoint: requests queue instead of
    // going to saturated endpoints.
    let dispatched = "kvepp_flow_control_dequeued_total{outcome=\"dispatched\"}";
    assert_eq!(metric(admin, dispatched).await, 0.0);
    swap_link(
        &files.link,
        &files.version(
            "v4",
            "unknown_models: pass-through\nmax_in_flight_per_endpoint: 1\n\
             flow_control: {enabled: true, max_queue_per_priority: 64, max_wait_ms: 10000}\n",
        ),
    );
    let cfg = wait_version(admin, 4).await;
    assert_eq!(cfg["flow_control"]["enabled"], true);
    wait_for("requests queued and dispatched", || async move {
        (metric(admin, dispatched).await > 0.0).then_some(())
    })
    .await;

    // 5. Tenant rate limits turned on: a tenant past its burst gets 429 with retry-after, another
    // tenant and the untagged load go on.
    let v4 = "unknown_models: pass-through\nmax_in_flight_per_endpoint: 1\n\
              flow_control: {enabled: true, max_queue_per_priority: 64, max_wait_ms: 10000}\n";
    swap_link(
        &files.link,
        &files.version(
            "v5",
            &format!(
                "{v4}rate_limits: {{default: {{requests_per_second: 0.5, request_burst: 2}}}}\n"
            ),
        ),
    );
    let cfg = wait_version(admin, 5).await;
    assert_eq!(cfg["rate_limits"]["default"]["request_burst"], 2.0);
    let as_tenant = |tenant: &'static str| async move {
        http(
            envoy.addr,
            "POST",
            "/v1/completions",
            &[
                ("content-type", "application/json"),
                ("x-llm-d-inference-fairness-id", tenant),
            ],
            r#"{"model":"m","prompt":"tenant"}"#,
        )
        .await
    };
    for _ in 0..2 {
        assert_eq!(as_tenant("tenant-a").await.status, 200);
    }
    let r = as_tenant("tenant-a").await;
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("retry-after"), Some("2"));
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    assert_eq!(as_tenant("tenant-b").await.status, 200, "another tenant");
    assert_eq!(
        metric(
            admin,
            "kvepp_rate_limited_requests_total{tenant=\"tenant-a\"}"
        )
        .await,
        1.0
    );

    // 6. An invalid file: rejected as a whole and counted; version 5 stays in effect.
    let rejected = "kvepp_config_reloads_total{result=\"rejected\"}";
    swap_link(
        &files.link,
        &files.version(
            "bad",
            "flow_control: {max_queue_per_priority: 0}\nno_such_field: 1\n",
        ),
    );
    wait_for("invalid file rejected", || async move {
        (metric(admin, rejected).await >= 1.0).then_some(())
    })
    .await;
    assert_eq!(config_version(admin).await.0, 5);
    assert_eq!(probe(envoy.addr, "nope", "x").await.0, 200);
    // A zero rate is refused on reload as at load.
    swap_link(
        &files.link,
        &files.version(
            "bad-rate",
            &format!("{v4}rate_limits: {{default: {{requests_per_second: 0}}}}\n"),
        ),
    );
    wait_for("zero rate rejected", || async move {
        (metric(admin, rejected).await >= 2.0).then_some(())
    })
    .await;
    assert_eq!(config_version(admin).await.0, 5);

    stop_tx.send(true).unwrap();
    for c in clients {
        c.await.unwrap();
    }
    let failed = count(&outcomes, |o| o.status != 200);
    println!(
        "reload under load: {} requests, {failed} failed",
        count(&outcomes, |_| true)
    );
    assert_eq!(failed, 0, "failed requests under reloads:\n{}", log());
    assert!(
        child.try_wait().unwrap().is_none(),
        "kvepp exited:\n{}",
        log()
    );
    assert_eq!(child.id(), pid, "the same process throughout");
    let log = log();
    assert!(log.contains("configuration reloaded"), "{log}");
    assert!(log.contains("configuration reload rejected"), "{log}");
}

/// `kvepp serve` on fresh ports over `manifests`, exporting traces as `env` says: (metrics
/// address, ext_proc address, process).
fn traced_kvepp(
    manifests: &Path,
    env: &[(&str, String)],
    log: &Path,
) -> (SocketAddr, SocketAddr, tokio::process::Child) {
    let (grpc, health, metrics) = (free_port(), free_port(), free_port());
    let ports = [grpc.to_string(), health.to_string(), metrics.to_string()];
    let args: Vec<&std::ffi::OsStr> = vec![
        "serve".as_ref(),
        "--pool-name".as_ref(),
        "pool".as_ref(),
        "--bind-address".as_ref(),
        "127.0.0.1".as_ref(),
        "--manifests-dir".as_ref(),
        manifests.as_os_str(),
        "--manifests-poll-ms".as_ref(),
        "20".as_ref(),
        "--grpc-port".as_ref(),
        ports[0].as_ref(),
        "--grpc-health-port".as_ref(),
        ports[1].as_ref(),
        "--metrics-port".as_ref(),
        ports[2].as_ref(),
    ];
    let child = spawn_kvepp(&args, env, log);
    (
        ([127, 0, 0, 1], metrics).into(),
        ([127, 0, 0, 1], grpc).into(),
        child,
    )
}

/// [`traced_kvepp`] once it is ready. Its ports were free a moment before it bound them, so
/// another process may have taken one meanwhile: a kvepp that exits before it is ready is
/// started again on other ports (three tries), and its log is shown when none gets ready.
async fn ready_traced_kvepp(
    manifests: &Path,
    env: &[(&str, String)],
    log: &Path,
) -> (SocketAddr, SocketAddr, tokio::process::Child) {
    for _ in 0..3 {
        let (admin, ext_proc, mut child) = traced_kvepp(manifests, env, log);
        let started = wait_for("kvepp ready or exited", || {
            let exited = child.try_wait().unwrap().is_some();
            async move {
                if exited {
                    return Some(false);
                }
                is_ready(admin).await.then_some(true)
            }
        })
        .await;
        if started {
            return (admin, ext_proc, child);
        }
    }
    panic!(
        "kvepp exited before it was ready, three times:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

/// A traced kvepp (as `env` configures its exporter) over `backends`, behind Envoy.
struct Traced {
    _dir: TempDir,
    log_path: PathBuf,
    admin: SocketAddr,
    envoy: Envoy,
    _child: tokio::process::Child,
}

impl Traced {
    async fn start(backends: &[&str], env: &[(&str, String)]) -> Traced {
        let backends = echo_backends(backends).await;
        let dir = TempDir::new("traces");
        let manifests = manifests_dir(dir.path(), &backends);
        let log_path = dir.path().join("kvepp.log");
        let (admin, ext_proc, child) = ready_traced_kvepp(&manifests, env, &log_path).await;
        let envoy = Envoy::start(bootstrap(), ext_proc).await;
        Traced {
            _dir: dir,
            log_path,
            admin,
            envoy,
            _child: child,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn decisions_are_spans_of_the_request_trace_and_the_engine_joins_it() {
    let collector = otlp::Collector::start().await;
    let env = [
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://{}", collector.addr),
        ),
        ("OTEL_SERVICE_NAME", "kvepp-under-test".to_owned()),
        ("OTEL_BSP_SCHEDULE_DELAY", "50".to_owned()),
    ];
    let t = Traced::start(&["a", "b"], &env).await;
    let (envoy, admin) = (&t.envoy, t.admin);
    let log = || t.log();

    // A request in a trace: kvepp's span is the child of the client's, and the engine gets a
    // traceparent naming kvepp's span.
    let (trace_id, parent) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let body = serde_json::json!({"model": "m", "prompt": "a long prompt to trace. ".repeat(20)});
    let traceparent = format!("00-{trace_id}-{parent}-01");
    let r = http(
        envoy.addr,
        "POST",
        "/v1/completions",
        &[
            ("content-type", "application/json"),
            ("traceparent", &traceparent),
            ("tracestate", "vendor=1"),
        ],
        body.to_string(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", log());
    let seen = r.json()["traceparent"].as_str().unwrap_or("").to_owned();
    let parts: Vec<&str> = seen.split('-').collect();
    assert_eq!(parts.len(), 4, "the engine's traceparent: {seen:?}");
    assert_eq!(parts[1], trace_id, "the engine is in the client's trace");
    assert_ne!(parts[2], parent, "the engine's parent is kvepp's span");
    let route = wait_for("kvepp.route span exported", || {
        let spans = collector.spans();
        async move {
            spans
                .into_iter()
                .find(|s| s.span.name == "kvepp.route" && hex(&s.span.trace_id) == trace_id)
        }
    })
    .await;
    assert_eq!(route.service, "kvepp-under-test");
    assert_eq!(hex(&route.span.parent_span_id), parent);
    assert_eq!(
        hex(&route.span.span_id),
        parts[2],
        "the engine's parent span"
    );
    let served = r.json()["destination"].as_str().unwrap_or("").to_owned();
    for (key, want) in [
        ("kvepp.pool", "default/pool"),
        ("gen_ai.request.model", "m"),
        ("kvepp.target_model", "m"),
        ("kvepp.outcome", "routed"),
        ("kvepp.candidates", "2"),
        ("kvepp.picker", "kv-aware"),
        ("kvepp.cost_model", "predicted-completion"),
        ("kvepp.endpoint", served.as_str()),
    ] {
        assert_eq!(route.attr(key).as_deref(), Some(want), "{key} in {route:?}");
    }
    assert!(route.attr("kvepp.priority").is_some());
    assert!(route.attr("kvepp.cached_blocks").is_some());
    // Its stages, as its children.
    let children = wait_for("stage spans exported", || {
        let spans = collector.spans();
        let id = route.span.span_id.clone();
        async move {
            let mut names: Vec<String> = spans
                .into_iter()
                .filter(|s| s.span.parent_span_id == id)
                .map(|s| s.span.name)
                .collect();
            names.sort();
            (names.len() >= 3).then_some(names)
        }
    })
    .await;
    assert_eq!(children, ["kvepp.body", "kvepp.pick", "kvepp.tokenize"]);

    // A malformed traceparent: a new root trace, and the request is answered as without one.
    let r = http(
        envoy.addr,
        "POST",
        "/v1/completions",
        &[
            ("content-type", "application/json"),
            ("traceparent", "00-not-a-trace-01"),
        ],
        serde_json::json!({"model": "nope", "prompt": "x"}).to_string(),
    )
    .await;
    assert_eq!(r.status, 404);
    let rejected = wait_for("the 404's span exported", || {
        let spans = collector.spans();
        async move {
            spans
                .into_iter()
                .find(|s| s.attr("kvepp.outcome").as_deref() == Some("404"))
        }
    })
    .await;
    assert!(rejected.span.parent_span_id.is_empty(), "a new root");
    assert_eq!(
        rejected.attr("kvepp.reason").as_deref(),
        Some("unknown_model")
    );
    assert_ne!(hex(&rejected.span.trace_id), trace_id);
    let exported = "kvepp_trace_spans_exported_total";
    // The counter moves when the collector's answer is back, after it has the spans.
    wait_for("exported spans counted", || async move {
        (metric(admin, exported).await >= 5.0).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_dead_collector_leaves_routing_untouched() {
    // Nothing listens there.
    let env = [
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://127.0.0.1:{}", free_port()),
        ),
        ("OTEL_BSP_SCHEDULE_DELAY", "20".to_owned()),
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "300".to_owned()),
        ("OTEL_BSP_MAX_QUEUE_SIZE", "8".to_owned()),
    ];
    let t = Traced::start(&["a"], &env).await;
    let (envoy, admin) = (&t.envoy, t.admin);
    let mut failed = 0;
    for i in 0..200 {
        let (status, _) = probe(envoy.addr, "m", &format!("request {i}")).await;
        failed += usize::from(status != 200);
    }
    assert_eq!(failed, 0);
    let dropped = |reason: &'static str| async move {
        metric(
            admin,
            &format!("kvepp_trace_spans_dropped_total{{reason=\"{reason}\"}}"),
        )
        .await
    };
    wait_for("failed exports counted", || async move {
        (dropped("export_failed").await > 0.0).then_some(())
    })
    .await;
    // 200 decisions × 4 spans against a queue of 8: the rest were dropped, never waited for.
    assert!(dropped("queue_full").await > 0.0);
}

#[tokio::test]
async fn spans_go_over_otlp_http_too() {
    let collector = otlp::Collector::start_http().await;
    let env = [
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://{}", collector.addr),
        ),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf".to_owned()),
        ("OTEL_BSP_SCHEDULE_DELAY", "50".to_owned()),
    ];
    let t = Traced::start(&["a"], &env).await;
    assert_eq!(probe(t.envoy.addr, "m", "over http").await.0, 200);
    let route = wait_for("kvepp.route span over OTLP/HTTP", || {
        let spans = collector.spans();
        async move { spans.into_iter().find(|s| s.span.name == "kvepp.route") }
    })
    .await;
    assert_eq!(route.service, "kvepp");
    assert_eq!(route.attr("kvepp.outcome").as_deref(), Some("routed"));
}
