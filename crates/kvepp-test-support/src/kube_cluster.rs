//! A real Kubernetes API server: etcd and kube-apiserver, built from the Go module proxy at pinned
//! versions by `scripts/install-kube.sh` (or named by `ETCD_BIN`, `KUBE_APISERVER_BIN` and
//! `HELM_BIN`), started on 127.0.0.1 ephemeral ports in a directory of their own and stopped on
//! drop; or, with [`EXTERNAL`] set, a cluster of your own.
//!
//! The API server runs as in a cluster, less the controllers: TLS with a certificate of a
//! throwaway CA, token authentication (a static admin token in `system:masters`; ServiceAccount
//! tokens signed with a generated key, issued by the TokenRequest API), RBAC authorization, and
//! kvepp's CRDs from `manifests/kubernetes/crds` applied and established. No controller,
//! scheduler or kubelet runs: a test creates Pods, EndpointSlices and the inference objects and
//! patches their status as those would ([`KubeCluster::put`], [`KubeCluster::patch_status`]).
//!
//! What a test can do to it that a cluster does: restart the API server under open watches
//! ([`KubeCluster::restart_apiserver`]), compact etcd's history so that an old resourceVersion is
//! gone ([`KubeCluster::compact`]; with [`Options::watch_cache`] off a watch from it gets etcd's
//! 410 Gone), refuse a client by RBAC or by its token ([`KubeCluster::service_account_kubeconfig`],
//! [`KubeCluster::token_kubeconfig`], [`KubeCluster::expired_token`]).
//!
//! Collections are named by their REST paths, as in [`crate::kube_api`], so a test's objects
//! read the same against either.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use base64::Engine as _;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams,
};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use serde_json::{json, Value};

use crate::harness::{free_port, http, repo_root};
pub use crate::pod_network::EXTERNAL;
use crate::TempDir;

/// Pods in namespace `default`.
pub const PODS: &str = "/api/v1/namespaces/default/pods";
/// CustomResourceDefinitions (cluster-scoped).
pub const CRDS: &str = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions";
/// How long the API server may take to become ready.
const START_DEADLINE: Duration = Duration::from_secs(90);
/// The field manager of the test's writes.
const MANAGER: &str = "kvepp-tests";
/// The issuer (and audience) of ServiceAccount tokens.
const ISSUER: &str = "https://kubernetes.default.svc";

/// The built tools (see `scripts/install-kube.sh`).
#[derive(Debug, Clone)]
pub struct Binaries {
    pub etcd: PathBuf,
    pub kube_apiserver: PathBuf,
    pub helm: PathBuf,
}

/// The tools, from `ETCD_BIN` / `KUBE_APISERVER_BIN` / `HELM_BIN` when all are set, else from
/// `scripts/install-kube.sh` (which builds them once and caches them by version).
pub fn binaries() -> &'static Binaries {
    static BINARIES: OnceLock<Binaries> = OnceLock::new();
    BINARIES.get_or_init(|| {
        let [etcd, kube_apiserver, helm] = installed(
            "install-kube.sh",
            ["ETCD_BIN", "KUBE_APISERVER_BIN", "HELM_BIN"],
        );
        Binaries {
            etcd,
            kube_apiserver,
            helm,
        }
    })
}

/// The paths a `scripts/<script>` prints as `NAME=path` lines: each from the environment
/// variable `NAME` when every one is set, else from the script's output (it builds what is not
/// cached yet).
pub fn installed<const N: usize>(script: &str, names: [&str; N]) -> [PathBuf; N] {
    let from_env = names.map(|k| std::env::var_os(k).map(PathBuf::from));
    if from_env.iter().all(Option::is_some) {
        return from_env.map(|p| p.expect("set"));
    }
    let script = repo_root().join("scripts").join(script);
    let out = Command::new(&script)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{} failed:\n{text}", script.display());
    names.map(|k| {
        text.lines()
            .find_map(|l| l.strip_prefix(k)?.strip_prefix('='))
            .map(PathBuf::from)
            .unwrap_or_else(|| panic!("{} printed no {k}:\n{text}", script.display()))
    })
}

/// What `helm template kvepp manifests/helm/kvepp --namespace default -f
/// manifests/helm/values/<values>.yaml` renders.
pub fn helm_template(values: &str) -> String {
    let out = Command::new(&binaries().helm)
        .args(["template", "kvepp"])
        .arg(repo_root().join("manifests/helm/kvepp"))
        .args(["--namespace", "default", "-f"])
        .arg(repo_root().join(format!("manifests/helm/values/{values}.yaml")))
        .output()
        .expect("helm runs");
    assert!(
        out.status.success(),
        "helm template with {values}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf8")
}

/// How the API server runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// The API server's watch cache (on in every cluster). Off, watches are served by etcd
    /// directly: a watch from a compacted resourceVersion gets 410 Gone at once.
    pub watch_cache: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options { watch_cache: true }
    }
}

/// A running etcd and kube-apiserver (see the module doc).
pub struct KubeCluster {
    dir: TempDir,
    /// etcd, when this harness runs the API server.
    etcd: Option<Child>,
    etcd_addr: SocketAddr,
    apiserver: Option<Child>,
    /// The API server's URL.
    server: String,
    options: Options,
    admin: kube::Client,
    ca_pem: String,
    /// The admin's kubeconfig on an external cluster ([`EXTERNAL`]); `None`: the local one.
    external: Option<PathBuf>,
    admin_token: String,
    /// The ServiceAccount token signing key (PKCS#8 DER, ECDSA P-256).
    signing_key: Vec<u8>,
    /// Restarts so far (each API server's log has its own file).
    restarts: usize,
}

impl Drop for KubeCluster {
    fn drop(&mut self) {
        for mut child in [self.apiserver.take(), self.etcd.take()]
            .into_iter()
            .flatten()
        {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl KubeCluster {
    /// etcd and kube-apiserver with default [`Options`], ready, with kvepp's CRDs established.
    pub async fn start() -> KubeCluster {
        Self::start_with(Options::default()).await
    }

    pub async fn start_with(options: Options) -> KubeCluster {
        if let Some(kubeconfig) = std::env::var_os(EXTERNAL) {
            return Self::external(PathBuf::from(kubeconfig), options).await;
        }
        let bins = binaries();
        let dir = TempDir::new("kube-cluster");
        let d = dir.path();
        // The serving certificate, from a CA the clients trust.
        let mut ca_params = CertificateParams::new(vec!["kvepp test cluster CA".to_owned()])
            .expect("CA parameters");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        // Names of their own: with rcgen's one default name for both, OpenSSL clients take the
        // serving certificate for a self-signed one.
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "kvepp test cluster CA");
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("CA key"))
            .expect("CA");
        let serving_key = KeyPair::generate().expect("serving key");
        let mut serving = CertificateParams::new(vec![
            "127.0.0.1".to_owned(),
            "localhost".to_owned(),
            "kubernetes.default.svc".to_owned(),
        ])
        .expect("serving parameters");
        serving
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        let serving = serving
            .signed_by(&serving_key, &ca)
            .expect("serving certificate");
        let signing = KeyPair::generate().expect("ServiceAccount signing key");
        let admin_token = format!(
            "admin-{:016x}",
            crate::fnv64(d.to_string_lossy().as_bytes())
        );
        for (file, text) in [
            ("ca.pem", ca.pem()),
            ("serving.pem", serving.pem()),
            ("serving-key.pem", serving_key.serialize_pem()),
            ("sa.key", signing.serialize_pem()),
            ("sa.pub", signing.public_key_pem()),
            (
                "tokens.csv",
                format!("{admin_token},admin,admin-uid,\"system:masters\"\n"),
            ),
        ] {
            std::fs::write(d.join(file), text).expect("cluster file");
        }

        let etcd_addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let peer = format!("http://127.0.0.1:{}", free_port());
        let client_url = format!("http://{etcd_addr}");
        let etcd = Command::new(&bins.etcd)
            .arg("--data-dir")
            .arg(d.join("etcd"))
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("default={peer}")])
            .args(["--unsafe-no-fsync", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log_file(d, "etcd.log"))
            .stderr(log_file(d, "etcd.log"))
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", bins.etcd.display()));
        let server = format!("https://127.0.0.1:{}", free_port());
        let kubeconfig = write_kubeconfig(d, "admin", &server, &ca.pem(), &admin_token);
        let admin = client(&kubeconfig).await;
        let mut cluster = KubeCluster {
            dir,
            etcd: Some(etcd),
            etcd_addr,
            apiserver: None,
            server,
            options,
            admin,
            ca_pem: ca.pem(),
            external: None,
            admin_token,
            signing_key: signing.serialize_der(),
            restarts: 0,
        };
        crate::wait_until("etcd healthy", START_DEADLINE, || async {
            let up = tokio::net::TcpStream::connect(etcd_addr).await.is_ok();
            (up && http(etcd_addr, "GET", "/health", &[], "").await.status == 200).then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}:\n{}", cluster.log("etcd.log")));
        cluster.start_apiserver().await;
        cluster.apply_crds().await;
        cluster
    }

    /// The cluster of kubeconfig `path` (its current context, cluster-admin), with kvepp's CRDs
    /// applied.
    async fn external(path: PathBuf, options: Options) -> KubeCluster {
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{EXTERNAL}={}: {e}", path.display()));
        let kc: Value = serde_yaml::from_str(&text).expect("a kubeconfig");
        let context = kc["current-context"].as_str().expect("current-context");
        let named = |list: &str, name: &str| -> Value {
            kc[list]
                .as_array()
                .and_then(|l| l.iter().find(|e| e["name"] == name))
                .cloned()
                .unwrap_or_else(|| panic!("{}: no {list} entry {name}", path.display()))
        };
        let cluster_name = named("contexts", context)["context"]["cluster"].clone();
        let cluster = named("clusters", cluster_name.as_str().expect("context.cluster"));
        let server = cluster["cluster"]["server"]
            .as_str()
            .expect("server")
            .to_owned();
        let ca_pem = match (
            cluster["cluster"]["certificate-authority-data"].as_str(),
            cluster["cluster"]["certificate-authority"].as_str(),
        ) {
            (Some(data), _) => String::from_utf8(
                base64::engine::general_purpose::STANDARD
                    .decode(data)
                    .expect("certificate-authority-data"),
            )
            .expect("a PEM CA"),
            (None, Some(file)) => std::fs::read_to_string(file).expect("certificate-authority"),
            (None, None) => panic!("{}: the cluster needs a CA", path.display()),
        };
        let admin = client(&path).await;
        let cluster = KubeCluster {
            dir: TempDir::new("kube-external"),
            etcd: None,
            etcd_addr: ([127, 0, 0, 1], 0).into(),
            apiserver: None,
            server,
            options,
            admin,
            ca_pem,
            external: Some(path),
            admin_token: String::new(),
            signing_key: Vec::new(),
            restarts: 0,
        };
        cluster.apply_crds().await;
        cluster
    }

    /// Panics, naming `what`, on an external cluster.
    fn local(&self, what: &str) {
        assert!(
            self.external.is_none(),
            "{what} needs the API server this harness runs: unset {EXTERNAL}"
        );
    }

    /// Starts kube-apiserver on its port and waits until `/readyz` answers 200.
    pub async fn start_apiserver(&mut self) {
        self.local("starting the API server");
        assert!(self.apiserver.is_none(), "the API server is running");
        let d = self.dir.path();
        let bins = binaries();
        let log = format!("apiserver-{}.log", self.restarts);
        let mut cmd = Command::new(&bins.kube_apiserver);
        cmd.args(["--etcd-servers", &format!("http://{}", self.etcd_addr)])
            .args([
                "--bind-address",
                "127.0.0.1",
                "--advertise-address",
                "127.0.0.1",
            ])
            .args([
                "--secure-port",
                self.server.rsplit(':').next().expect("port"),
            ])
            // The endpoint reconciler would publish 127.0.0.1 as the `kubernetes` Service's
            // endpoint, which the API refuses (loopback); no pod here needs that Service.
            .args(["--endpoint-reconciler-type", "none"])
            .arg("--tls-cert-file")
            .arg(d.join("serving.pem"))
            .arg("--tls-private-key-file")
            .arg(d.join("serving-key.pem"))
            .arg("--client-ca-file")
            .arg(d.join("ca.pem"))
            .arg("--token-auth-file")
            .arg(d.join("tokens.csv"))
            .args(["--service-account-issuer", ISSUER])
            .arg("--service-account-key-file")
            .arg(d.join("sa.pub"))
            .arg("--service-account-signing-key-file")
            .arg(d.join("sa.key"))
            .args(["--authorization-mode", "RBAC"])
            .args(["--service-cluster-ip-range", "10.96.0.0/24"])
            // No controller-manager creates the `default` ServiceAccount that this admission
            // plugin would require of every Pod.
            .args(["--disable-admission-plugins", "ServiceAccount"])
            // kube-apiserver compacts etcd itself every 5 minutes; here only the test does.
            .args(["--etcd-compaction-interval", "0"])
            .arg(format!("--watch-cache={}", self.options.watch_cache))
            .stdin(Stdio::null())
            .stdout(log_file(d, &log))
            .stderr(log_file(d, &log));
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", bins.kube_apiserver.display()));
        let admin = self.admin.clone();
        let ready = crate::wait_until("kube-apiserver ready", START_DEADLINE, || {
            let admin = admin.clone();
            let exited = child.try_wait().ok().flatten();
            async move {
                if let Some(status) = exited {
                    return Some(Err(format!("kube-apiserver exited ({status})")));
                }
                let r = http_request("GET", "/readyz", Vec::new());
                let text = admin.request_text(r).await.ok()?;
                (text.trim() == "ok").then_some(Ok(()))
            }
        })
        .await
        .and_then(|r| r);
        self.apiserver = Some(child);
        if let Err(e) = ready {
            panic!("{e}:\n{}", self.log(&log));
        }
    }

    /// Kills the API server (as a crash would: open watches end without a goodbye).
    pub fn stop_apiserver(&mut self) {
        self.local("stopping the API server");
        if let Some(mut a) = self.apiserver.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
        self.restarts += 1;
    }

    /// Kills the API server and starts a new one on the same port and etcd.
    pub async fn restart_apiserver(&mut self) {
        self.stop_apiserver();
        self.start_apiserver().await;
    }

    /// Compacts etcd's history up to its current revision (physically): a resourceVersion from
    /// before is gone. Returns that revision.
    pub async fn compact(&self) -> u64 {
        self.local("compacting etcd");
        let r = etcd_call(
            self.etcd_addr,
            "/v3/kv/range",
            json!({"key": base64::engine::general_purpose::STANDARD.encode("/")}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let rev: u64 = r.json()["header"]["revision"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .expect("etcd's revision");
        let r = etcd_call(
            self.etcd_addr,
            "/v3/kv/compaction",
            json!({"revision": rev.to_string(), "physical": true}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        rev
    }

    /// The admin client (`system:masters`).
    pub fn admin(&self) -> kube::Client {
        self.admin.clone()
    }

    /// A kubeconfig with the admin's credentials.
    pub fn kubeconfig(&self, dir: &Path) -> PathBuf {
        match &self.external {
            Some(path) => path.clone(),
            None => self.token_kubeconfig(dir, "admin", &self.admin_token),
        }
    }

    /// A kubeconfig that presents `token` (named `name`, which names the file too).
    pub fn token_kubeconfig(&self, dir: &Path, name: &str, token: &str) -> PathBuf {
        write_kubeconfig(dir, name, &self.server, &self.ca_pem, token)
    }

    /// A kubeconfig with a fresh token of ServiceAccount `namespace/name` (TokenRequest API, one
    /// hour), as a pod of that ServiceAccount gets.
    pub async fn service_account_kubeconfig(
        &self,
        dir: &Path,
        namespace: &str,
        name: &str,
    ) -> PathBuf {
        let body = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600}});
        let path = format!("/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token");
        let req = http_request("POST", &path, serde_json::to_vec(&body).expect("json"));
        let reply: Value = self
            .admin
            .request(req)
            .await
            .unwrap_or_else(|e| panic!("TokenRequest for {namespace}/{name}: {e}"));
        let token = reply["status"]["token"].as_str().expect("a token");
        self.token_kubeconfig(dir, name, token)
    }

    /// A ServiceAccount token for `namespace/name` that this cluster signed and that expired an
    /// hour ago: the API server refuses it (401).
    pub fn expired_token(&self, namespace: &str, name: &str) -> String {
        self.local("a token signed with the cluster's key");
        use ring::signature::{EcdsaKeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
        let rng = ring::rand::SystemRandom::new();
        let key =
            EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &self.signing_key, &rng)
                .expect("signing key");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs();
        let b64 = |v: &Value| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .encode(serde_json::to_vec(v).expect("json"))
        };
        let header = b64(&json!({"alg": "ES256", "typ": "JWT"}));
        let claims = b64(&json!({
            "iss": ISSUER, "aud": [ISSUER],
            "sub": format!("system:serviceaccount:{namespace}:{name}"),
            "iat": now - 7200, "nbf": now - 7200, "exp": now - 3600,
        }));
        let signed = format!("{header}.{claims}");
        let sig = key.sign(&rng, signed.as_bytes()).expect("sign");
        format!(
            "{signed}.{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(sig.as_ref())
        )
    }

    /// Creates or replaces `obj` in `collection` (server-side apply, forced, as one field
    /// manager): the object afterwards is `obj` plus what the server defaults.
    pub async fn put(&self, collection: &str, obj: Value) {
        self.apply(collection, obj, false).await;
    }

    /// [`Self::put`] as a server-side dry run: admission, validation and defaulting run, nothing
    /// is stored.
    pub async fn put_dry_run(&self, collection: &str, obj: Value) {
        self.apply(collection, obj, true).await;
    }

    async fn apply(&self, collection: &str, mut obj: Value, dry_run: bool) {
        let (api, resource) = self.api_of_kind(collection, obj["kind"].as_str());
        obj["apiVersion"] = resource.api_version.clone().into();
        obj["kind"] = resource.kind.clone().into();
        let name = obj["metadata"]["name"]
            .as_str()
            .expect("metadata.name")
            .to_owned();
        let mut params = PatchParams::apply(MANAGER).force();
        if dry_run {
            params = params.dry_run();
        }
        api.patch(&name, &params, &Patch::Apply(&obj))
            .await
            .unwrap_or_else(|e| panic!("apply {collection}/{name}: {e}"));
    }

    /// Deletes `name` from `collection` (it must exist).
    pub async fn delete(&self, collection: &str, name: &str) {
        let (api, _) = self.api(collection);
        api.delete(name, &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("delete {collection}/{name}: {e}"));
    }

    /// Merges `status` into the status subresource of `collection/name`, as a controller or the
    /// kubelet reports it.
    pub async fn patch_status(&self, collection: &str, name: &str, status: Value) {
        let (api, _) = self.api(collection);
        api.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({ "status": status })),
        )
        .await
        .unwrap_or_else(|e| panic!("status of {collection}/{name}: {e}"));
    }

    /// Applies every object of a multi-document YAML text (server-side apply, as `kubectl apply
    /// --server-side` does), each in its own namespace or `default`.
    pub async fn apply_yaml(&self, text: &str) {
        for v in documents(text) {
            let collection = self.collection_of(&v).await;
            self.put(&collection, v).await;
        }
    }

    /// [`Self::apply_yaml`] as a server-side dry run; returns how many objects the server accepted.
    pub async fn apply_yaml_dry_run(&self, text: &str) -> usize {
        let docs = documents(text);
        for v in &docs {
            let collection = self.collection_of(v).await;
            self.put_dry_run(&collection, v.clone()).await;
        }
        docs.len()
    }

    /// The REST collection of an object from its apiVersion and kind (API discovery).
    pub async fn collection_of(&self, obj: &Value) -> String {
        let api_version = obj["apiVersion"].as_str().expect("apiVersion");
        let kind = obj["kind"].as_str().expect("kind");
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        let gvk = GroupVersionKind::gvk(group, version, kind);
        let (res, caps) = kube::discovery::pinned_kind(&self.admin, &gvk)
            .await
            .unwrap_or_else(|e| panic!("{api_version} {kind} is not served: {e}"));
        let prefix = if group.is_empty() {
            "/api/v1".to_owned()
        } else {
            format!("/apis/{api_version}")
        };
        match caps.scope {
            kube::discovery::Scope::Namespaced => {
                let ns = obj["metadata"]["namespace"].as_str().unwrap_or("default");
                format!("{prefix}/namespaces/{ns}/{}", res.plural)
            }
            kube::discovery::Scope::Cluster => format!("{prefix}/{}", res.plural),
        }
    }

    /// The API server's Prometheus metrics.
    pub async fn metrics_text(&self) -> String {
        self.admin
            .request_text(http_request("GET", "/metrics", Vec::new()))
            .await
            .expect("the API server's /metrics")
    }

    /// A log file of the cluster (`etcd.log`, `apiserver-N.log`), for failure messages.
    pub fn log(&self, file: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(file)).unwrap_or_default()
    }

    /// kvepp's CRDs (`manifests/kubernetes/crds/crds.yaml`), applied and established.
    async fn apply_crds(&self) {
        let path = repo_root().join("manifests/kubernetes/crds/crds.yaml");
        let text = std::fs::read_to_string(&path).expect("the shipped CRDs");
        self.apply_yaml(&text).await;
        for v in documents(&text) {
            if let Some(name) = v["metadata"]["name"].as_str() {
                self.wait_established(name).await;
            }
        }
    }

    /// Waits until CRD `name` is established (its resources served).
    pub async fn wait_established(&self, name: &str) {
        let (api, _) = self.api(CRDS);
        crate::wait_until(&format!("CRD {name} established"), START_DEADLINE, || {
            let api = api.clone();
            async move {
                let crd = api.get(name).await.ok()?;
                let conditions = crd.data["status"]["conditions"].as_array()?.clone();
                conditions
                    .iter()
                    .any(|c| c["type"] == "Established" && c["status"] == "True")
                    .then_some(())
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }

    /// The dynamic API of a collection named by its REST path.
    fn api(&self, collection: &str) -> (Api<DynamicObject>, ApiResource) {
        self.api_of_kind(collection, None)
    }

    /// [`Self::api`] for objects of `kind` (else the kind the collection's plural names).
    fn api_of_kind(
        &self,
        collection: &str,
        kind: Option<&str>,
    ) -> (Api<DynamicObject>, ApiResource) {
        let parts: Vec<&str> = collection.trim_start_matches('/').split('/').collect();
        let (group, version, rest) = match parts.as_slice() {
            ["api", version, rest @ ..] => ("", *version, rest),
            ["apis", group, version, rest @ ..] => (*group, *version, rest),
            _ => panic!("not a collection path: {collection}"),
        };
        let (namespace, plural) = match rest {
            ["namespaces", ns, plural] => (Some(*ns), *plural),
            [plural] => (None, *plural),
            _ => panic!("not a collection path: {collection}"),
        };
        let kind = kind.unwrap_or_else(|| crate::kube_api::kind_of_plural(plural));
        let gvk = GroupVersionKind::gvk(group, version, kind);
        let resource = ApiResource::from_gvk_with_plural(&gvk, plural);
        let api = match namespace {
            Some(ns) => Api::namespaced_with(self.admin.clone(), ns, &resource),
            None => Api::all_with(self.admin.clone(), &resource),
        };
        (api, resource)
    }
}

/// The objects of a multi-document YAML text (empty documents skipped).
pub fn documents(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|doc| serde::Deserialize::deserialize(doc).expect("YAML document"))
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// The status code the API server answers `client` for one request: 200 for any success, else
/// the refusal's code (401, 403, 404, …). A PATCH body is a JSON merge patch.
pub async fn status_of(
    client: &kube::Client,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> u16 {
    let bytes = body
        .map(|b| serde_json::to_vec(&b).expect("json"))
        .unwrap_or_default();
    let mut req = http_request(method, path, bytes);
    if method == "PATCH" {
        req.headers_mut().insert(
            "content-type",
            http::HeaderValue::from_static("application/merge-patch+json"),
        );
    }
    match client.request_text(req).await {
        Ok(_) => 200,
        Err(kube::Error::Api(s)) => s.code,
        Err(e) => panic!("{method} {path}: {e}"),
    }
}

/// One call to etcd's JSON gateway (the v3 gRPC API over HTTP).
async fn etcd_call(etcd: SocketAddr, path: &str, body: Value) -> crate::harness::HttpResponse {
    let body = serde_json::to_vec(&body).expect("json");
    http(
        etcd,
        "POST",
        path,
        &[("content-type", "application/json")],
        body,
    )
    .await
}

fn log_file(dir: &Path, name: &str) -> std::fs::File {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(name))
        .expect("log file")
}

fn http_request(method: &str, path: &str, body: Vec<u8>) -> http::Request<Vec<u8>> {
    http::Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(body)
        .expect("request")
}

/// A kubeconfig file `<name>.kubeconfig` in `dir` for the API server at `server`.
fn write_kubeconfig(dir: &Path, name: &str, server: &str, ca_pem: &str, token: &str) -> PathBuf {
    let path = dir.join(format!("{name}.kubeconfig"));
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\nusers:\n- name: {name}\n  user:\n    token: {token}\ncontexts:\n- name: test\n  context: {{cluster: test, user: {name}, namespace: default}}\ncurrent-context: test\n"
    );
    std::fs::write(&path, text).expect("write kubeconfig");
    path
}

/// A client from a kubeconfig file.
pub async fn client(kubeconfig: &Path) -> kube::Client {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .expect("client configuration");
    kube::Client::try_from(config).expect("client")
}
