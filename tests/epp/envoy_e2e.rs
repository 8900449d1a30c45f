//! End to end: real HTTP requests through a real Envoy 1.40 process, kvepp as its ext_proc EPP, and
//! real HTTP backends on 127.0.0.1 that report which one answered.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvepp_test_support::fnv64;
use kvepp_test_support::prelude::*;
use tokio::sync::watch;

fn mode(mode: &str) -> serde_yaml::Value {
    let mut b = bootstrap();
    set_request_body_mode(&mut b, mode);
    b
}

/// Sends `n` requests for model `m` and returns how many each backend served, checking that every
/// response came from the endpoint kvepp named (Envoy connected where the header said).
async fn spread(
    envoy: &Envoy,
    backends: &HashMap<String, SocketAddr>,
    n: usize,
) -> HashMap<String, usize> {
    let mut seen = HashMap::new();
    for i in 0..n {
        let body = format!("{{\"model\":\"m\",\"prompt\":\"request {i}\"}}");
        // A client-supplied destination must be overwritten by kvepp.
        let r = http(
            envoy.addr,
            "POST",
            "/v1/completions",
            &[
                ("content-type", "application/json"),
                ("x-gateway-destination-endpoint", "127.0.0.1:1"),
            ],
            body.clone(),
        )
        .await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let j = r.json();
        let name = j["backend"].as_str().expect("backend").to_owned();
        assert_eq!(
            j["destination"].as_str(),
            Some(backends[&name].to_string().as_str()),
            "served by the picked endpoint"
        );
        assert_eq!(j["body_len"].as_u64(), Some(body.len() as u64));
        assert_eq!(
            j["body_fnv"].as_str(),
            Some(format!("{:016x}", fnv64(body.as_bytes())).as_str())
        );
        *seen.entry(name).or_insert(0) += 1;
    }
    seen
}

#[tokio::test]
async fn routes_real_traffic_in_both_body_modes_on_one_server() {
    let addrs = echo_backends(&["a", "b"]).await;
    let backends: HashMap<String, SocketAddr> =
        [("a".to_string(), addrs[0]), ("b".to_string(), addrs[1])].into();
    let epp = Epp::start(&pool_manifests(&[("a", addrs[0]), ("b", addrs[1])]), |_| {}).await;
    let duplex = Envoy::start(mode("FULL_DUPLEX_STREAMED"), epp.grpc).await;
    let buffered = Envoy::start(mode("BUFFERED"), epp.grpc).await;
    for envoy in [&duplex, &buffered] {
        let seen = spread(envoy, &backends, 24).await;
        assert_eq!(
            seen.len(),
            2,
            "least-loaded with random tie-break uses both endpoints: {seen:?}"
        );

        // Weighted target model: the body reaches the backend with only `model` changed.
        let r = post_json(envoy.addr, r#"{"model":"rw","prompt":"hi"}"#).await;
        let j = r.json();
        assert_eq!(j["model"], "rw-target");
        let expected = r#"{"model":"rw-target","prompt":"hi"}"#;
        assert_eq!(j["body_len"].as_u64(), Some(expected.len() as u64));
        assert_eq!(
            j["content_length"].as_str(),
            Some(expected.len().to_string().as_str()),
            "Content-Length fixed"
        );
        assert_eq!(
            j["body_fnv"].as_str(),
            Some(format!("{:016x}", fnv64(expected.as_bytes())).as_str())
        );

        // A request without a body is routed too.
        let r = http(envoy.addr, "GET", "/v1/models", &[], "").await;
        assert_eq!(r.status, 200);
        assert!(backends.contains_key(r.json()["backend"].as_str().unwrap()));
    }
    let text = epp.metrics_text().await;
    for needle in [
        "kvepp_requests_total{model=\"m\",target_model=\"m\"",
        "kvepp_requests_total{model=\"rw\",target_model=\"rw-target\"",
        "kvepp_pick_duration_seconds_count",
        "kvepp_ready_endpoints 2",
    ] {
        assert!(text.contains(needle), "metrics lack {needle}:\n{text}");
    }
    epp.stop().await;
}

#[tokio::test]
async fn one_mib_body_passes_byte_identical_in_both_modes() {
    let addrs = echo_backends(&["a"]).await;
    let epp = Epp::start(&pool_manifests(&[("a", addrs[0])]), |_| {}).await;
    let mut prompt = String::new();
    while prompt.len() < 1 << 20 {
        prompt.push_str("Ünïcödé ☃ 𝄞 text, ");
    }
    let body = format!("{{\"model\":\"m\",\"prompt\":\"{prompt}\",\"max_tokens\":1}}");
    assert!(body.len() >= 1 << 20, "{}", body.len());
    for m in ["FULL_DUPLEX_STREAMED", "BUFFERED"] {
        let envoy = Envoy::start(mode(m), epp.grpc).await;
        let r = post_json(envoy.addr, body.clone()).await;
        assert_eq!(r.status, 200, "{m}: {}", String::from_utf8_lossy(&r.body));
        let j = r.json();
        assert_eq!(j["body_len"].as_u64(), Some(body.len() as u64), "{m}");
        assert_eq!(
            j["body_fnv"].as_str(),
            Some(format!("{:016x}", fnv64(body.as_bytes())).as_str()),
            "{m}"
        );
        assert_eq!(
            j["content_length"].as_str(),
            Some(body.len().to_string().as_str()),
            "{m}"
        );
    }
    epp.stop().await;
}

#[tokio::test]
async fn errors_reach_the_client_as_json() {
    let addrs = echo_backends(&["a"]).await;
    let epp = Epp::start(&pool_manifests(&[("a", addrs[0])]), |_| {}).await;
    for m in ["FULL_DUPLEX_STREAMED", "BUFFERED"] {
        let envoy = Envoy::start(mode(m), epp.grpc).await;
        for (body, code) in [
            ("{\"model\":", 400),
            ("{\"prompt\":\"no model\"}", 400),
            ("{\"model\":\"nobody-serves-this\"}", 404),
        ] {
            let r = post_json(envoy.addr, body).await;
            assert_eq!(r.status, code, "{m} {body}");
            assert_eq!(r.header("content-type"), Some("application/json"));
            assert_eq!(r.json()["error"]["code"], code);
        }
    }
    // No ready endpoint → 503.
    epp.write_manifest(
        "pool.yaml",
        &(pool_yaml("pool") + &standard_models() + &slice_yaml("a", addrs[0], false)),
    );
    let envoy = Envoy::start(mode("FULL_DUPLEX_STREAMED"), epp.grpc).await;
    let r = wait_for("503 once the endpoint is not ready", || async {
        let r = post_json(envoy.addr, r#"{"model":"m"}"#).await;
        (r.status == 503).then_some(r)
    })
    .await;
    assert_eq!(r.json()["error"]["type"], "service_unavailable");
    epp.stop().await;
}

/// A backend that holds every request until released, counting arrivals.
async fn hold_backend(
    name: &'static str,
    arrived: Arc<AtomicUsize>,
    release: watch::Receiver<bool>,
) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(move || {
        let arrived = arrived.clone();
        let mut release = release.clone();
        async move {
            arrived.fetch_add(1, Ordering::SeqCst);
            let _ = release.wait_for(|r| *r).await;
            format!("{{\"backend\":\"{name}\"}}")
        }
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

#[tokio::test]
async fn sheddable_gets_429_when_every_endpoint_is_saturated() {
    let arrived = Arc::new(AtomicUsize::new(0));
    let (release, rx) = watch::channel(false);
    let a = hold_backend("a", arrived.clone(), rx.clone()).await;
    let b = hold_backend("b", arrived.clone(), rx).await;
    // In-flight saturation only: these backends hold every request, /metrics scrapes included.
    let epp = Epp::start(&pool_manifests(&[("a", a), ("b", b)]), |c| {
        c.max_in_flight_per_endpoint = 1;
        c.engine_metrics.enabled = false;
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let gw = envoy.addr;
    let held: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async move { post_json(gw, r#"{"model":"crit"}"#).await }))
        .collect();
    wait_for("both endpoints busy", || async {
        (arrived.load(Ordering::SeqCst) == 2).then_some(())
    })
    .await;
    let r = post_json(gw, r#"{"model":"shed"}"#).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.json()["error"]["code"], 429);
    release.send_replace(true);
    let mut served = Vec::new();
    for h in held {
        let r = h.await.unwrap();
        assert_eq!(r.status, 200);
        served.push(r.json()["backend"].as_str().unwrap().to_owned());
    }
    served.sort();
    assert_eq!(
        served,
        ["a", "b"],
        "the second Critical request went to the less loaded endpoint"
    );
    wait_for("Sheddable admitted once the responses ended", || async {
        (post_json(gw, r#"{"model":"shed"}"#).await.status == 200).then_some(())
    })
    .await;
    epp.stop().await;
}

#[tokio::test]
async fn subset_hint_set_by_envoy_is_honoured() {
    let addrs = echo_backends(&["a", "b"]).await;
    let epp = Epp::start(&pool_manifests(&[("a", addrs[0]), ("b", addrs[1])]), |_| {}).await;
    let mut b = bootstrap();
    set_subset_hint(&mut b, &[addrs[1].to_string(), "10.255.0.1:8000".into()]);
    let envoy = Envoy::start(b, epp.grpc).await;
    for _ in 0..10 {
        let r = post_json(envoy.addr, r#"{"model":"m"}"#).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.json()["backend"], "b");
    }
    let mut b = bootstrap();
    set_subset_hint(&mut b, &["10.255.0.1:8000".into()]);
    let envoy = Envoy::start(b, epp.grpc).await;
    let r = post_json(envoy.addr, r#"{"model":"m"}"#).await;
    assert_eq!(r.status, 503);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("subset"));
    epp.stop().await;
}

#[tokio::test]
async fn endpoints_coming_and_going_follow_the_manifests() {
    let addrs = echo_backends(&["a", "b"]).await;
    let epp = Epp::start(&pool_manifests(&[("a", addrs[0])]), |_| {}).await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    for _ in 0..5 {
        assert_eq!(
            post_json(envoy.addr, r#"{"model":"m"}"#).await.json()["backend"],
            "a"
        );
    }
    // b becomes ready and a goes away, in a second file and an edit of the first.
    epp.write_manifest("b.yaml", &slice_yaml("b", addrs[1], true));
    epp.write_manifest(
        "pool.yaml",
        &(pool_yaml("pool") + &standard_models() + &slice_yaml("a", addrs[0], false)),
    );
    wait_for("traffic moves to b", || async {
        (post_json(envoy.addr, r#"{"model":"m"}"#).await.json()["backend"] == "b").then_some(())
    })
    .await;
    for _ in 0..5 {
        assert_eq!(
            post_json(envoy.addr, r#"{"model":"m"}"#).await.json()["backend"],
            "b"
        );
    }
    epp.stop().await;
}

/// Envoy keeps the client's framing of an unchanged streamed body: Content-Length stays, chunked
/// stays chunked. A rewritten body gets its exact new length either way.
#[tokio::test]
async fn client_framing_is_kept_in_both_modes() {
    let addrs = echo_backends(&["a"]).await;
    let epp = Epp::start(&pool_manifests(&[("a", addrs[0])]), |_| {}).await;
    let body = r#"{"model":"m","prompt":"same bytes"}"#;
    let chunked = [
        ("content-type", "application/json"),
        ("transfer-encoding", "chunked"),
    ];
    for m in ["FULL_DUPLEX_STREAMED", "BUFFERED"] {
        let envoy = Envoy::start(mode(m), epp.grpc).await;
        for n in [10usize, 300_000] {
            let b = format!("{{\"model\":\"m\",\"prompt\":\"{}\"}}", "x".repeat(n));
            let j = post_json(envoy.addr, b.clone()).await.json();
            assert_eq!(
                j["content_length"].as_str(),
                Some(b.len().to_string().as_str()),
                "{m} {n}"
            );
        }
        let j = http(envoy.addr, "POST", "/v1/completions", &chunked, body)
            .await
            .json();
        assert_eq!(
            j["body_fnv"].as_str(),
            Some(format!("{:016x}", fnv64(body.as_bytes())).as_str()),
            "{m}"
        );
        if m == "FULL_DUPLEX_STREAMED" {
            assert_eq!(
                (j["transfer_encoding"].as_str(), &j["content_length"]),
                (Some("chunked"), &serde_json::Value::Null),
                "{m}"
            );
        }
        let j = http(
            envoy.addr,
            "POST",
            "/v1/completions",
            &chunked,
            r#"{"model":"rw"}"#,
        )
        .await
        .json();
        assert_eq!(
            j["content_length"].as_str(),
            Some(r#"{"model":"rw-target"}"#.len().to_string().as_str()),
            "{m}"
        );
        assert_eq!(j["model"], "rw-target");
    }
    epp.stop().await;
}

/// The local bootstrap with its route sent to an ordinary cluster (the backend at `default`)
/// instead of the endpoint kvepp picks: a request that reached the router without a decision
/// would land there.
fn with_default_cluster(mut b: serde_yaml::Value, default: SocketAddr) -> serde_yaml::Value {
    let route = &mut b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["route_config"]["virtual_hosts"][0]["routes"][0]["route"];
    route["cluster"] = "default_backend".into();
    let cluster: serde_yaml::Value = serde_yaml::from_str(&format!(
        "name: default_backend\ntype: STATIC\nconnect_timeout: 2s\nload_assignment:\n  cluster_name: default_backend\n  endpoints:\n  - lb_endpoints:\n    - endpoint:\n        address:\n          socket_address: {{address: {}, port_value: {}}}\n",
        default.ip(),
        default.port()
    ))
    .unwrap();
    b["static_resources"]["clusters"]
        .as_sequence_mut()
        .unwrap()
        .push(cluster);
    b
}

/// A body over `max_body_bytes` gets kvepp's 413 (JSON) in both body modes, also when Envoy hands
/// it over as one gRPC message larger than kvepp's message limit; with fail-close and a route to an
/// ordinary cluster, such a request never reaches a backend.
#[tokio::test]
async fn oversized_bodies_get_413_from_kvepp_and_never_pass_undecided() {
    let arrived = Arc::new(AtomicUsize::new(0));
    let (_release, rx) = watch::channel(true);
    let default = hold_backend("default", arrived.clone(), rx).await;
    let addrs = echo_backends(&["a"]).await;
    let epp = Epp::start(&pool_manifests(&[("a", addrs[0])]), |c| {
        c.max_body_bytes = 64 << 10;
    })
    .await;
    // 256 KiB: in BUFFERED mode Envoy sends it in one message, over kvepp's gRPC limit.
    let big = format!(
        "{{\"model\":\"m\",\"prompt\":\"{}\"}}",
        "x".repeat(256 << 10)
    );
    for m in ["BUFFERED", "FULL_DUPLEX_STREAMED"] {
        let envoy = Envoy::start(with_default_cluster(mode(m), default), epp.grpc).await;
        let r = post_json(envoy.addr, big.clone()).await;
        assert_eq!(r.status, 413, "{m}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()["error"]["code"], 413, "{m}: kvepp's JSON error");
        // A small request is decided and goes on to the route's cluster.
        let ok = post_json(envoy.addr, r#"{"model":"m","prompt":"hi"}"#).await;
        assert_eq!(ok.status, 200, "{m}");
        assert_eq!(ok.json()["backend"], "default", "{m}");
    }
    assert_eq!(
        arrived.load(Ordering::SeqCst),
        2,
        "only the two decided requests reached the default cluster"
    );
    let rejected = epp
        .metric("kvepp_rejected_requests_total{reason=\"body_too_large\"}")
        .await;
    assert_eq!(rejected, Some(2.0));
    epp.stop().await;
}

/// The 9 MiB body against the default 8 MiB limit, in both body modes. Envoy's buffer is raised to
/// 16 MiB so that in BUFFERED mode Envoy hands kvepp the whole body as one gRPC message larger than
/// kvepp's message limit (the case that used to end the stream with OK and no decision).
#[tokio::test]
async fn nine_mib_body_gets_413_from_kvepp_with_the_default_limit() {
    let addrs = echo_backends(&["a"]).await;
    let epp = Epp::start(&pool_manifests(&[("a", addrs[0])]), |_| {}).await;
    let big = format!("{{\"model\":\"m\",\"prompt\":\"{}\"}}", "x".repeat(9 << 20));
    for m in ["FULL_DUPLEX_STREAMED", "BUFFERED"] {
        let mut b = mode(m);
        b["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] =
            (16u64 << 20).into();
        let envoy = Envoy::start(b, epp.grpc).await;
        let r = post_json(envoy.addr, big.clone()).await;
        assert_eq!(r.status, 413, "{m}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()["error"]["code"], 413, "{m}: kvepp's JSON error");
    }
    epp.stop().await;
}

/// An InferenceModelRewrite of `model` to weighted `targets` (`group`: llm-d.ai or the Inference
/// Extension's), one rule.
fn rewrite_yaml(group: &str, name: &str, model: Option<&str>, targets: &[(&str, u32)]) -> String {
    let matches = match model {
        Some(m) => format!("[{{model: {{type: Exact, value: {m}}}}}]"),
        None => "[]".into(),
    };
    let targets: Vec<String> = targets
        .iter()
        .map(|(t, w)| format!("{{modelRewrite: {t}, weight: {w}}}"))
        .collect();
    format!(
        "---\napiVersion: {group}/v1alpha2\nkind: InferenceModelRewrite\nmetadata: {{name: {name}}}\nspec:\n  poolRef: {{group: inference.networking.k8s.io, name: pool}}\n  rules:\n  - matches: {matches}\n    targets: [{}]\n",
        targets.join(", ")
    )
}

/// The model the backend was sent for a request naming `model`, with a fairness id when given.
async fn served_model(envoy: &Envoy, model: &str, tenant: Option<&str>) -> String {
    let mut headers = vec![("content-type", "application/json")];
    if let Some(t) = tenant {
        headers.push(("x-llm-d-inference-fairness-id", t));
    }
    let body = format!(r#"{{"model":"{model}","prompt":"rewrite me"}}"#);
    let r = http(envoy.addr, "POST", "/v1/completions", &headers, body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()["model"].as_str().expect("model").to_owned()
}

#[tokio::test]
async fn inference_model_rewrites_alias_split_fall_back_and_keep_a_conversation_on_its_target() {
    let addrs = echo_backends(&["a"]).await;
    let rewrites = |v2: u32| {
        rewrite_yaml("llm-d.ai", "alias", Some("food"), &[("food-v1", 1)])
            + &rewrite_yaml(
                "inference.networking.x-k8s.io",
                "canary",
                Some("split"),
                &[("split-v1", 100 - v2), ("split-v2", v2)],
            )
            + &rewrite_yaml("llm-d.ai", "fallback", None, &[("m", 1)])
            + &rewrite_yaml(
                "llm-d.ai",
                "to-nothing",
                Some("gone"),
                &[("unserved-v1", 1)],
            )
    };
    let epp = Epp::start(
        &(pool_manifests(&[("a", addrs[0])]) + &rewrites(10)),
        |_| {},
    )
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    // Exact: the alias; catch-all: any model nothing names (no 404); an InferenceModel's own
    // name is taken by the catch-all too, as every request no earlier rule took.
    assert_eq!(served_model(&envoy, "food", None).await, "food-v1");
    assert_eq!(served_model(&envoy, "no-such-model", None).await, "m");
    assert_eq!(served_model(&envoy, "rw", None).await, "m");
    // A target the engine does not serve: its 404 reaches the client, logged and counted.
    let r = post_json(envoy.addr, r#"{"model":"gone","prompt":"x"}"#).await;
    assert_eq!(r.status, 404);
    let series =
        r#"kvepp_model_rewrite_unserved_total{rewrite="to-nothing",target_model="unserved-v1"}"#;
    assert_eq!(epp.metric(series).await, Some(1.0));
    let series = r#"kvepp_model_rewrites_total{rewrite="alias",target_model="food-v1"}"#;
    assert_eq!(epp.metric(series).await, Some(1.0));
    // Weights: 90/10 over 1000 requests without a key (binomial sd ~9.5).
    let mut v2 = 0;
    for _ in 0..1000 {
        if served_model(&envoy, "split", None).await == "split-v2" {
            v2 += 1;
        }
    }
    assert!(
        (55..=145).contains(&v2),
        "10% of 1000 expected on split-v2, got {v2}"
    );
    // A conversation (its fairness id) keeps its target, every turn.
    let tenants: Vec<String> = (0..200).map(|i| format!("conversation-{i}")).collect();
    let mut before = Vec::new();
    for t in &tenants {
        let first = served_model(&envoy, "split", Some(t)).await;
        for _ in 0..2 {
            assert_eq!(served_model(&envoy, "split", Some(t)).await, first, "{t}");
        }
        before.push(first);
    }
    // Moving 40 points to v2 moves only conversations from v1 to v2, about 40% of them.
    epp.write_manifest("rewrites.yaml", &rewrites(50));
    epp.write_manifest("pool.yaml", &pool_manifests(&[("a", addrs[0])]));
    let moved = || async {
        let mut moved = 0;
        for (t, b) in tenants.iter().zip(&before) {
            let now = served_model(&envoy, "split", Some(t)).await;
            if now != *b {
                assert_eq!((b.as_str(), now.as_str()), ("split-v1", "split-v2"), "{t}");
                moved += 1;
            }
        }
        moved
    };
    wait_for("the new weights", || async {
        (moved().await > 0).then_some(())
    })
    .await;
    let moved = moved().await;
    assert!(
        (50..=110).contains(&moved),
        "about 80 of 200 conversations move, {moved} did"
    );
    epp.stop().await;
}

/// Tenant rate limits with two active-active replicas: each enforces its share of the limit
/// (the rate and burst divided by the replicas it knows: itself and its replica-sync peer), so
/// a tenant's burst of 4 is 2 through each replica and 4 in total; another tenant is unaffected.
#[tokio::test]
async fn two_replicas_each_enforce_their_share_of_a_tenants_limit() {
    let addrs = echo_backends(&["a"]).await;
    let (p1, p2) = (free_port(), free_port());
    let replica = |own: u16, peer: u16| {
        move |c: &mut kvepp::config::Config| {
            c.replica_sync.bind = Some(format!("tcp://127.0.0.1:{own}"));
            c.replica_sync.advertise = Some(format!("tcp://127.0.0.1:{own}"));
            c.replica_sync.peers = vec![format!("tcp://127.0.0.1:{peer}")];
            c.rate_limits.default = Some(kvepp::admission::TenantLimit {
                requests_per_second: Some(0.01),
                request_burst: Some(4.0),
                ..Default::default()
            });
        }
    };
    let m = pool_manifests(&[("a", addrs[0])]);
    let one = Epp::start(&m, replica(p1, p2)).await;
    let two = Epp::start(&m, replica(p2, p1)).await;
    let (e1, e2) = (
        Envoy::start(bootstrap(), one.grpc).await,
        Envoy::start(bootstrap(), two.grpc).await,
    );
    let ask = |envoy: SocketAddr, tenant: &'static str| async move {
        http(
            envoy,
            "POST",
            "/v1/completions",
            &[
                ("content-type", "application/json"),
                ("x-llm-d-inference-fairness-id", tenant),
            ],
            r#"{"model":"m","prompt":"limited"}"#,
        )
        .await
        .status
    };
    let mut statuses = Vec::new();
    for envoy in [e1.addr, e2.addr] {
        for _ in 0..3 {
            statuses.push(ask(envoy, "tenant").await);
        }
    }
    assert_eq!(
        statuses,
        [200, 200, 429, 200, 200, 429],
        "2 + 2 of a burst of 4"
    );
    assert_eq!(ask(e1.addr, "another").await, 200);
    one.stop().await;
    two.stop().await;
}

/// Every request format kvepp reads, through Envoy: the model read from each body (and rewritten
/// in place when its InferenceModel says so), a body without its model refused 400 as for the
/// OpenAI formats, and a path kvepp does not know routed by load with its body untouched and
/// counted by path.
#[tokio::test]
async fn each_request_format_is_read_and_routed_and_unknown_paths_pass_untouched() {
    let addrs = echo_backends(&["a"]).await;
    let epp = Epp::start(&pool_manifests(&[("a", addrs[0])]), |_| {}).await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let post = |path: &'static str, body: String| {
        let addr = envoy.addr;
        async move {
            http(
                addr,
                "POST",
                path,
                &[("content-type", "application/json")],
                body,
            )
            .await
        }
    };
    let formats = [
        ("/v1/completions", r#""prompt":"Once upon a time""#),
        (
            "/v1/chat/completions",
            r#""messages":[{"role":"user","content":"Hi"}]"#,
        ),
        (
            "/v1/responses",
            r#""instructions":"Be brief.","input":[{"role":"user","content":[{"type":"input_text","text":"Hi"}]}]"#,
        ),
        (
            "/v1/messages",
            r#""max_tokens":8,"system":"Be brief.","messages":[{"role":"user","content":[{"type":"text","text":"Hi"}]}]"#,
        ),
        (
            "/inference/v1/generate",
            r#""token_ids":[1,2,3,4],"sampling_params":{"max_tokens":4}"#,
        ),
        ("/v1/embeddings", r#""input":["first text","second text"]"#),
    ];
    for (path, rest) in formats {
        // `rw` has an InferenceModel that rewrites it to `rw-target`.
        let r = post(path, format!(r#"{{"model":"rw",{rest}}}"#)).await;
        assert_eq!(
            r.status,
            200,
            "{path}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let j = r.json();
        assert_eq!(
            (j["path"].as_str(), j["model"].as_str()),
            (Some(path), Some("rw-target"))
        );
        let r = post(path, format!("{{{rest}}}")).await;
        assert_eq!(r.status, 400, "{path} without a model");
        assert!(
            r.json()["error"]["message"]
                .as_str()
                .unwrap()
                .contains("\"model\""),
            "{path}"
        );
        let r = post(path, format!(r#"{{"model":"rw",{rest}"#)).await;
        assert_eq!(r.status, 400, "{path} malformed");
    }
    // An unknown path: routed, body byte for byte as sent (no model rewrite), counted.
    let body = r#"{"model":"rw","text":"SGLang's native generate"}"#;
    let r = post("/generate", body.to_owned()).await;
    assert_eq!(r.status, 200);
    let j = r.json();
    assert_eq!(j["model"], "rw", "untouched");
    assert_eq!(
        j["body_fnv"].as_str(),
        Some(format!("{:016x}", fnv64(body.as_bytes())).as_str())
    );
    assert_eq!(
        epp.metric(r#"kvepp_unknown_path_requests_total{path="/generate"}"#)
            .await,
        Some(1.0)
    );
    // Malformed for a known path is counted like today's formats.
    assert_eq!(
        epp.metric(r#"kvepp_rejected_requests_total{reason="missing_model"}"#)
            .await,
        Some(formats.len() as f64)
    );
    epp.stop().await;
}
