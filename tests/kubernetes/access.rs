//! What the API server grants and refuses kvepp (RBAC, tokens), and what it accepts of the shipped
//! manifests and chart.

use super::*;

/// The kvepp binary with its credentials where every Kubernetes tool finds them (`KUBECONFIG`,
/// no flag, no manifests directory); its log goes to a file.
struct Binary {
    child: Child,
    metrics: SocketAddr,
    grpc: SocketAddr,
    log: PathBuf,
}

impl Binary {
    fn start(kubeconfig: &Path, dir: &Path, tag: &str) -> Binary {
        let (grpc, metrics) = (free_port(), free_port());
        let log = dir.join(format!("{tag}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let config = dir.join(format!("{tag}.yaml"));
        std::fs::write(&config, "engine_metrics: {enabled: false}\n").unwrap();
        let child = Command::new(BIN)
            .args(["serve", "--config"])
            .arg(&config)
            .args(["--pool-name", "pool", "--bind-address", "127.0.0.1"])
            .args(["--grpc-port", &grpc.to_string()])
            .args(["--grpc-health-port", &free_port().to_string()])
            .args(["--metrics-port", &metrics.to_string()])
            .env("KUBECONFIG", kubeconfig)
            .env_remove("KVEPP_MANIFESTS_DIR")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        Binary {
            child,
            metrics: ([127, 0, 0, 1], metrics).into(),
            grpc: ([127, 0, 0, 1], grpc).into(),
            log,
        }
    }

    async fn metric(&self, series: &str) -> Option<f64> {
        tokio::net::TcpStream::connect(self.metrics).await.ok()?;
        let r = http(self.metrics, "GET", "/metrics", &[], "").await;
        kvepp_test_support::find_sample(&String::from_utf8_lossy(&r.body), series)
    }

    async fn ready(&self) -> Option<u16> {
        tokio::net::TcpStream::connect(self.metrics).await.ok()?;
        Some(http(self.metrics, "GET", "/ready", &[], "").await.status)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the API server's refusal shows: the gauge, /ready 503, and the log line.
    async fn wait_refused(&self, why: &str) {
        let refused = "kvepp_discovery_refused{resource=\"endpointslices\"}";
        kvepp_test_support::wait_until("kvepp reports the refusal", BACKOFF_DEADLINE, || async {
            (self.metric(refused).await == Some(1.0)).then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.log()));
        assert_eq!(self.ready().await, Some(503), "not ready while refused");
        wait_for("the refusal's log line", || async {
            let log = self.log();
            (log.contains("the Kubernetes API server refuses kvepp") && log.contains(why))
                .then_some(())
        })
        .await;
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The RBAC objects of `manifests/kubernetes/base` (ServiceAccount, Role, bindings), as YAML.
fn base_rbac(kinds: &[&str]) -> String {
    let text =
        std::fs::read_to_string(repo_root().join("manifests/kubernetes/base/kvepp.yaml")).unwrap();
    documents(&text)
        .into_iter()
        .filter(|d| kinds.contains(&d["kind"].as_str().unwrap_or_default()))
        .map(|d| serde_yaml::to_string(&d).unwrap())
        .collect::<Vec<_>>()
        .join("---\n")
}

/// kvepp with its ServiceAccount's token and exactly the RBAC of `manifests/kubernetes/base`:
/// before the Role is bound the API server refuses it (403: a clear log line, not ready, never an
/// empty pool), once bound it syncs and routes through Envoy; with the same token the API server
/// refuses everything kvepp does not use (secrets, pods, every write, `get`, other namespaces).
/// A wrong token and an expired one (signed by the cluster's own key) are refused with 401, and
/// kvepp says so.
#[test]
fn rbac_grants_kvepp_exactly_what_it_uses() {
    in_pod_network!(rbac_grants_kvepp_exactly_what_it_uses, rbac_for_real);
}

async fn rbac_for_real() {
    let cluster = KubeCluster::start().await;
    let dir = TempDir::new("kube-rbac");
    let pods = Pods::start(&["pod-a"]).await;
    cluster.put(POOLS_V1, pool_v1("pool", 8000)).await;
    cluster
        .put(MODELS, model("chat", "chat", "pool", &[]))
        .await;
    pods.put(&cluster, &[true]).await;

    // The ServiceAccount alone: every list is refused.
    cluster.apply_yaml(&base_rbac(&["ServiceAccount"])).await;
    let kubeconfig = cluster
        .service_account_kubeconfig(dir.path(), "default", "kvepp")
        .await;
    let kvepp = Binary::start(&kubeconfig, dir.path(), "kvepp");
    kvepp.wait_refused("RBAC").await;
    assert_eq!(kvepp.metric("kvepp_ready_endpoints").await, Some(0.0));

    // The base's Role and bindings: kvepp syncs (after its backoff) and routes.
    cluster
        .apply_yaml(&base_rbac(&[
            "Role",
            "RoleBinding",
            "ClusterRole",
            "ClusterRoleBinding",
        ]))
        .await;
    kvepp_test_support::wait_until("ready once the Role is bound", BACKOFF_DEADLINE, || async {
        (kvepp.ready().await == Some(200)).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", kvepp.log()));
    assert_eq!(
        kvepp
            .metric("kvepp_discovery_refused{resource=\"endpointslices\"}")
            .await,
        Some(0.0)
    );
    let envoy = Envoy::start(bootstrap(), kvepp.grpc).await;
    let (seen, codes, _) = served_by(&envoy, "chat", 4).await;
    assert_eq!((seen, codes), (set(&["pod-a"]), vec![200; 4]));

    // What the token may and may not do.
    let sa = kube_cluster::client(&kubeconfig).await;
    let allowed = [
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices",
        "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools",
        "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/default/inferencepools",
        "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/default/inferencemodels",
        "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/default/inferencemodelrewrites",
        "/apis/llm-d.ai/v1alpha2/namespaces/default/inferenceobjectives",
        "/apis/llm-d.ai/v1alpha2/namespaces/default/inferencemodelrewrites",
    ];
    for path in allowed {
        assert_eq!(status_of(&sa, "GET", path, None).await, 200, "list {path}");
        let watch = format!("{path}?watch=true&timeoutSeconds=1");
        assert_eq!(
            status_of(&sa, "GET", &watch, None).await,
            200,
            "watch {path}"
        );
    }
    let slice_body = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "forged"}, "addressType": "IPv4", "endpoints": []});
    let refused: [(&str, String, Option<Value>); 9] = [
        ("GET", "/api/v1/namespaces/default/secrets".into(), None),
        (
            "GET",
            "/api/v1/namespaces/default/secrets/kvepp-api-token".into(),
            None,
        ),
        ("GET", "/api/v1/namespaces/default/pods".into(), None),
        ("GET", "/api/v1/namespaces/default/configmaps".into(), None),
        ("GET", format!("{POOLS_V1}/pool"), None),
        ("POST", SLICES.into(), Some(slice_body)),
        (
            "PATCH",
            format!("{POOLS_V1}/pool"),
            Some(json!({"metadata": {"labels": {"x": "y"}}})),
        ),
        ("DELETE", format!("{MODELS}/chat"), None),
        (
            "GET",
            "/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices".into(),
            None,
        ),
    ];
    for (method, path, body) in refused {
        assert_eq!(
            status_of(&sa, method, &path, body).await,
            403,
            "{method} {path}"
        );
    }
    drop(kvepp);

    // Tokens the API server does not accept: 401, a clear log line, not ready.
    for (tag, token) in [
        ("wrong", "not-a-token".to_owned()),
        ("expired", cluster.expired_token("default", "kvepp")),
    ] {
        let kc = cluster.token_kubeconfig(dir.path(), tag, &token);
        assert_eq!(
            status_of(&kube_cluster::client(&kc).await, "GET", SLICES, None).await,
            401,
            "the {tag} token"
        );
        let kvepp = Binary::start(&kc, dir.path(), tag);
        kvepp.wait_refused("credentials").await;
    }
}

/// What a platform team applies is accepted by a real API server (server-side dry run: admission,
/// validation, defaulting, the CRDs' schemas): the Kustomize overlays and the Helm chart's
/// renderings that need no third-party CRD.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_manifests_and_chart_pass_a_server_side_dry_run() {
    let cluster = KubeCluster::start().await;
    for overlay in ["single-replica", "active-active", "pd-pool"] {
        let text = kvepp_test_support::shipped::kustomize(&format!(
            "manifests/kubernetes/overlays/{overlay}"
        ));
        let text = String::from_utf8(text).unwrap();
        let n = cluster.apply_yaml_dry_run(&text).await;
        assert!(n >= 10, "overlay {overlay}: {n} objects");
    }
    for values in ["single-replica", "active-active", "pd-pool"] {
        let n = cluster
            .apply_yaml_dry_run(&kube_cluster::helm_template(values))
            .await;
        assert!(n >= 10, "chart with {values}: {n} objects");
    }
}
