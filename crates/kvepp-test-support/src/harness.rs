//! What an integration test of kvepp reaches for first: waiting on conditions with a deadline
//! (never sleeping "long enough"), ports, an HTTP client with its response, clients under steady
//! load, the manifests a pool is made of, echo backends, and a real Envoy in front of an EPP (the
//! shipped bootstrap, adapted). kvepp itself in-process is `epp` (feature `epp`); a test imports everything from `prelude`.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::body::Bytes;

pub const DEADLINE: Duration = Duration::from_secs(20);

/// Polls `cond` until it returns `Some`, panicking with `what` after the deadline.
pub async fn wait_for<T, F, Fut>(what: &str, cond: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    crate::wait_until(what, DEADLINE, cond)
        .await
        .unwrap_or_else(|e| panic!("timed out waiting for {e}"))
}

/// A port that was free a moment ago (for a child process that must bind it itself).
pub fn free_port() -> u16 {
    try_free_port().expect("a free port on 127.0.0.1")
}

/// [`free_port`], for callers that report the failure themselves.
pub fn try_free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

// ---------------------------------------------------------------- HTTP client

#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

impl HttpResponse {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    pub fn header(&self, k: &str) -> Option<&str> {
        self.headers.get(k).and_then(|v| v.to_str().ok())
    }
}

/// One HTTP/1.1 request on a fresh connection.
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> HttpResponse {
    let mut with_host = vec![("host", "test")];
    with_host.extend_from_slice(headers);
    let send = crate::client::request(addr, method, path, &with_host, body.into());
    let resp = tokio::time::timeout(DEADLINE, send)
        .await
        .expect("response in time")
        .unwrap_or_else(|e| panic!("{method} {path} to {addr}: {e}"));
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    HttpResponse {
        status,
        headers,
        body,
    }
}

pub async fn post_json(addr: SocketAddr, body: impl Into<Bytes>) -> HttpResponse {
    http(
        addr,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        body,
    )
    .await
}

/// What [`steady_load`]'s clients saw, request by request.
pub type Log = std::sync::Arc<std::sync::Mutex<Vec<Outcome>>>;

/// One client request's fate.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub start: std::time::Instant,
    pub end: std::time::Instant,
    pub status: u16,
    /// kvepp decided it (the backend saw the destination header).
    pub decided: bool,
}

/// `clients` clients sending requests back to back through `envoy` until `stop`; each one's
/// fate is logged.
pub fn steady_load(
    envoy: SocketAddr,
    clients: usize,
    stop: tokio::sync::watch::Receiver<bool>,
) -> (Log, Vec<tokio::task::JoinHandle<()>>) {
    let log = Log::default();
    let tasks = (0..clients)
        .map(|c| {
            let (log, stop) = (log.clone(), stop.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while !*stop.borrow() {
                    i += 1;
                    let body = format!("{{\"model\":\"m\",\"prompt\":\"client {c} request {i}\"}}");
                    let start = std::time::Instant::now();
                    let r = http(
                        envoy,
                        "POST",
                        "/v1/completions",
                        &[("content-type", "application/json")],
                        body,
                    )
                    .await;
                    let decided = r.status == 200 && r.json()["destination"].is_string();
                    log.lock().unwrap().push(Outcome {
                        start,
                        end: std::time::Instant::now(),
                        status: r.status,
                        decided,
                    });
                }
            })
        })
        .collect();
    (log, tasks)
}

/// How many logged requests `f` holds for.
pub fn count(log: &std::sync::Mutex<Vec<Outcome>>, f: impl Fn(&Outcome) -> bool) -> usize {
    log.lock().unwrap().iter().filter(|o| f(o)).count()
}

// ---------------------------------------------------------------- manifests

pub fn pool_yaml(name: &str) -> String {
    format!("apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferencePool\nmetadata: {{name: {name}}}\nspec: {{targetPortNumber: 8000, selector: {{app: test}}}}\n")
}

pub fn model_yaml(name: &str, criticality: &str, targets: &[(&str, u32)]) -> String {
    let targets: Vec<String> = targets
        .iter()
        .map(|(n, w)| format!("{{name: {n}, weight: {w}}}"))
        .collect();
    format!(
        "---\napiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferenceModel\nmetadata: {{name: {obj}}}\nspec: {{modelName: {name}, criticality: {criticality}, poolRef: {{name: pool}}, targetModels: [{t}]}}\n",
        obj = name.replace(['/', '.', '_'], "-").to_lowercase(),
        t = targets.join(", ")
    )
}

/// One EndpointSlice with one endpoint at `addr`.
pub fn slice_yaml(slice: &str, addr: SocketAddr, ready: bool) -> String {
    format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {slice}, labels: {{kubernetes.io/service-name: pool}}}}\naddressType: IPv4\nendpoints:\n- addresses: [\"{ip}\"]\n  conditions: {{ready: {ready}}}\n  targetRef: {{kind: Pod, name: {slice}}}\nports: [{{name: http, port: {port}}}]\n",
        ip = addr.ip(),
        port = addr.port()
    )
}

/// The standard test models: `m` (Standard), `crit` (Critical), `shed` (Sheddable), `rw` (always
/// rewritten to `rw-target`).
pub fn standard_models() -> String {
    [
        model_yaml("m", "Standard", &[]),
        model_yaml("crit", "Critical", &[]),
        model_yaml("shed", "Sheddable", &[]),
        model_yaml("rw", "Standard", &[("rw-target", 1)]),
    ]
    .concat()
}

/// Pool `pool` with the standard models and one ready slice per (name, address): the manifests
/// most tests start kvepp with.
pub fn pool_manifests(slices: &[(&str, SocketAddr)]) -> String {
    let mut m = pool_yaml("pool") + &standard_models();
    for (name, addr) in slices {
        m += &slice_yaml(name, *addr, true);
    }
    m
}

// ---------------------------------------------------------------- backends

pub async fn echo_backends(names: &[&str]) -> Vec<SocketAddr> {
    let mut out = Vec::new();
    for n in names {
        out.push(crate::spawn_echo_backend(n).await.expect("backend"));
    }
    out
}

// ---------------------------------------------------------------- Envoy

/// The workspace root (where `Cargo.lock` is), from whichever package's tests include this
/// harness.
pub fn repo_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.ancestors()
        .find(|d| d.join("Cargo.lock").exists())
        .map_or_else(|| here.clone(), std::path::Path::to_path_buf)
}

pub fn envoy_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        return p.into();
    }
    let p = repo_root().join(".venv/bin/envoy");
    assert!(p.exists(), "Envoy not found at {}: run scripts/install-envoy.sh (scripts/test.sh does) or set ENVOY_BIN", p.display());
    p
}

/// The shipped local bootstrap, as a YAML value to adapt.
pub fn bootstrap() -> serde_yaml::Value {
    crate::envoy::EnvoyProcess::bootstrap().expect("bootstrap yaml")
}

fn http_filters(b: &mut serde_yaml::Value) -> &mut Vec<serde_yaml::Value> {
    b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ["http_filters"]
        .as_sequence_mut()
        .expect("http_filters")
}

pub fn ext_proc_config(b: &mut serde_yaml::Value) -> &mut serde_yaml::Value {
    let filters = http_filters(b);
    let f = filters
        .iter_mut()
        .find(|f| f["name"] == "envoy.filters.http.ext_proc")
        .expect("ext_proc filter");
    &mut f["typed_config"]
}

pub fn set_request_body_mode(b: &mut serde_yaml::Value, mode: &str) {
    ext_proc_config(b)["processing_mode"]["request_body_mode"] = mode.into();
}

/// Puts a `set_metadata` filter before ext_proc that sets the subset hint to `subset`.
pub fn set_subset_hint(b: &mut serde_yaml::Value, subset: &[String]) {
    let filter: serde_yaml::Value = serde_yaml::from_str(&format!(
        "name: envoy.filters.http.set_metadata\ntyped_config:\n  \"@type\": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config\n  metadata:\n  - metadata_namespace: envoy.lb.subset_hint\n    value:\n      x-gateway-destination-endpoint-subset: {}\n",
        serde_json::to_string(subset).expect("json")
    ))
    .expect("filter yaml");
    http_filters(b).insert(0, filter);
}

pub struct Envoy {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    process: crate::envoy::EnvoyProcess,
}

impl Envoy {
    /// Starts Envoy with `bootstrap`, its ext_proc cluster pointed at `epp`, on ephemeral ports.
    pub async fn start(bootstrap: serde_yaml::Value, epp: SocketAddr) -> Envoy {
        let process = crate::envoy::EnvoyProcess::start_with(&envoy_bin(), bootstrap, epp)
            .await
            .expect("envoy");
        Envoy {
            addr: process.listener,
            admin: process.admin,
            process,
        }
    }

    pub fn log(&self) -> String {
        self.process.log()
    }
}
