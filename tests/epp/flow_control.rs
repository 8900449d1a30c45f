//! Today's Inference Extension and llm-d conventions through a real Envoy: InferenceObjectives
//! chosen by header (priority decides who is shed), flow control (requests wait for capacity in
//! priority order, sheddable ones are shed only when their queue is full, a client that leaves
//! gives up its place, a wait past the deadline is a 503), endpoint scores behind a flag, and an
//! InferencePool that names another picker.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use kvepp_test_support::prelude::*;
use tokio::sync::Semaphore;

/// A backend that answers one request per permit, recording the prompts in arrival order.
#[derive(Clone)]
struct Gate {
    addr: SocketAddr,
    arrived: Arc<Mutex<Vec<String>>>,
    permits: Arc<Semaphore>,
}

impl Gate {
    async fn start() -> Gate {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let arrived = Arc::new(Mutex::new(Vec::new()));
        let permits = Arc::new(Semaphore::new(0));
        let (a, p) = (arrived.clone(), permits.clone());
        let app = axum::Router::new().fallback(move |body: axum::body::Bytes| {
            let (arrived, permits) = (a.clone(), p.clone());
            async move {
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                let prompt = v["prompt"].as_str().unwrap_or_default().to_owned();
                arrived.lock().unwrap().push(prompt.clone());
                permits.acquire().await.unwrap().forget();
                format!("{{\"backend\":\"gate\",\"prompt\":\"{prompt}\"}}")
            }
        });
        tokio::spawn(async move { axum::serve(listener, app).await });
        Gate {
            addr,
            arrived,
            permits,
        }
    }

    fn arrived(&self) -> Vec<String> {
        self.arrived.lock().unwrap().clone()
    }
}

fn objective_yaml(name: &str, priority: i32, pool: &str) -> String {
    format!("---\napiVersion: llm-d.ai/v1alpha2\nkind: InferenceObjective\nmetadata: {{name: {name}}}\nspec: {{priority: {priority}, poolRef: {{name: {pool}}}}}\n")
}

fn manifests(backend: SocketAddr) -> String {
    pool_manifests(&[("gate", backend)])
        + &objective_yaml("high", 10, "pool")
        + &objective_yaml("std", 0, "pool")
        + &objective_yaml("low", -1, "pool")
}

/// A completions request naming `objective`, with `prompt` to recognise it at the backend.
async fn ask(gw: SocketAddr, objective: &str, prompt: &str) -> HttpResponse {
    http(
        gw,
        "POST",
        "/v1/completions",
        &[
            ("content-type", "application/json"),
            ("x-llm-d-inference-objective", objective),
        ],
        format!(r#"{{"model":"m","prompt":"{prompt}"}}"#),
    )
    .await
}

async fn queued(epp: &Epp, priority: i32) -> f64 {
    epp.metric(&format!(
        "kvepp_flow_control_queue_size{{priority=\"{priority}\"}}"
    ))
    .await
    .unwrap_or(0.0)
}

#[tokio::test]
async fn objectives_from_the_manifests_directory_decide_who_is_shed() {
    let gate = Gate::start().await;
    let epp = Epp::start(&manifests(gate.addr), |c| {
        c.max_in_flight_per_endpoint = 1;
        c.engine_metrics.enabled = false;
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let gw = envoy.addr;
    // Saturate the one endpoint.
    let busy = tokio::spawn(async move { ask(gw, "std", "busy").await });
    wait_for("the endpoint is busy", || async {
        (gate.arrived().len() == 1).then_some(())
    })
    .await;
    let r = ask(gw, "low", "shed me").await;
    assert_eq!(r.status, 429, "negative priority is sheddable");
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    // The Standard model with a higher-priority objective is not shed (it goes to the busy
    // endpoint without flow control).
    let high = tokio::spawn(async move { ask(gw, "high", "keep me").await });
    wait_for("the high-priority request reached the backend", || async {
        (gate.arrived().len() == 2).then_some(())
    })
    .await;
    let r = ask(gw, "missing", "x").await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    // Changed: `low` becomes important; deleted: `high` is unknown again; added: `batch`.
    epp.write_manifest(
        "objectives.yaml",
        &(objective_yaml("low", 3, "pool") + &objective_yaml("batch", -5, "pool")),
    );
    epp.write_manifest(
        "pool.yaml",
        &(pool_yaml("pool") + &standard_models() + &slice_yaml("gate", gate.addr, true)),
    );
    let low = wait_for("low is no longer shed", || async {
        let t = tokio::spawn(async move { ask(gw, "low", "now important").await });
        let n = gate.arrived().len();
        // Either it reaches the backend (not shed) or it was answered 429 at once.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        if t.is_finished() {
            assert_eq!(t.await.unwrap().status, 429);
            return None;
        }
        wait_for("it arrives", || async {
            (gate.arrived().len() > n).then_some(())
        })
        .await;
        Some(t)
    })
    .await;
    assert_eq!(ask(gw, "batch", "x").await.status, 429);
    assert_eq!(ask(gw, "high", "x").await.status, 404, "deleted");
    gate.permits.add_permits(3);
    for t in [busy, high, low] {
        assert_eq!(t.await.unwrap().status, 200);
    }
    epp.stop().await;
}

#[tokio::test]
async fn a_pool_that_names_another_picker_is_not_served() {
    let addrs = echo_backends(&["a"]).await;
    let pool = "apiVersion: inference.networking.k8s.io/v1\nkind: InferencePool\nmetadata: {name: pool}\nspec:\n  selector: {matchLabels: {app: test}}\n  targetPorts: [{number: 8000}]\n  endpointPickerRef: {name: other-epp, port: {number: 9002}}\n";
    let text = pool.to_owned() + &standard_models() + &slice_yaml("a", addrs[0], true);
    let epp = Epp::start_unready(&text, |c| {
        c.endpoint_picker_service = Some("kvepp".into());
        c.startup_wait_ms = 0;
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let r = post_json(envoy.addr, r#"{"model":"m"}"#).await;
    assert_eq!(r.status, 503);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not known"));
    // Named correctly, it is served.
    epp.write_manifest("pool.yaml", &text.replace("other-epp", "kvepp"));
    wait_for("served once it names kvepp", || async {
        (post_json(envoy.addr, r#"{"model":"m"}"#).await.status == 200).then_some(())
    })
    .await;
    epp.stop().await;
}

#[tokio::test]
async fn flow_control_serves_by_priority_as_capacity_frees_and_loses_nothing() {
    for body_mode in ["FULL_DUPLEX_STREAMED", "BUFFERED"] {
        let gate = Gate::start().await;
        let epp = Epp::start(&manifests(gate.addr), |c| {
            c.max_in_flight_per_endpoint = 1;
            c.engine_metrics.enabled = false;
            c.flow_control.enabled = true;
            c.flow_control.max_queue_per_priority = 2;
        })
        .await;
        let mut b = bootstrap();
        set_request_body_mode(&mut b, body_mode);
        let envoy = Envoy::start(b, epp.grpc).await;
        let gw = envoy.addr;
        let first = tokio::spawn(async move { ask(gw, "std", "first").await });
        wait_for("the endpoint is busy", || async {
            (gate.arrived().len() == 1).then_some(())
        })
        .await;
        // Two sheddable requests, then a high-priority one: all wait.
        let mut waiting = Vec::new();
        for (objective, prompt, before) in [("low", "low-1", 0), ("low", "low-2", 1)] {
            waiting.push(tokio::spawn(
                async move { ask(gw, objective, prompt).await },
            ));
            wait_for("queued", || async {
                (queued(&epp, -1).await == f64::from(before + 1)).then_some(())
            })
            .await;
        }
        waiting.push(tokio::spawn(async move { ask(gw, "high", "high-1").await }));
        wait_for("high queued", || async {
            (queued(&epp, 10).await == 1.0).then_some(())
        })
        .await;
        // The sheddable queue is full: 429 at once, while the others keep waiting.
        let r = ask(gw, "low", "low-3").await;
        assert_eq!(r.status, 429, "{body_mode}");
        assert!(r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("queue for priority -1 is full"));
        // A waiting client that disconnects gives up its place at once.
        let quitter = tokio::spawn(async move { ask(gw, "high", "quitter").await });
        wait_for("quitter queued", || async {
            (queued(&epp, 10).await == 2.0).then_some(())
        })
        .await;
        quitter.abort();
        wait_for("quitter left the queue", || async {
            (queued(&epp, 10).await == 1.0).then_some(())
        })
        .await;
        assert_eq!(
            gate.arrived(),
            ["first"],
            "nothing passed the saturated endpoint"
        );
        // Capacity frees one request at a time: the highest priority goes first, then arrival.
        gate.permits.add_permits(1);
        assert_eq!(first.await.unwrap().status, 200);
        for expected in ["high-1", "low-1", "low-2"] {
            wait_for("next request dispatched", || async {
                (gate.arrived().last().map(String::as_str) == Some(expected)).then_some(())
            })
            .await;
            gate.permits.add_permits(1);
        }
        for w in waiting {
            let r = w.await.unwrap();
            assert_eq!(
                r.status,
                200,
                "{body_mode}: {}",
                String::from_utf8_lossy(&r.body)
            );
        }
        assert_eq!(
            gate.arrived(),
            ["first", "high-1", "low-1", "low-2"],
            "{body_mode}: served by priority, the quitter never"
        );
        let text = epp.metrics_text().await;
        for (series, want) in [
            (
                "kvepp_flow_control_dequeued_total{outcome=\"dispatched\"}",
                3.0,
            ),
            (
                "kvepp_flow_control_dequeued_total{outcome=\"cancelled\"}",
                1.0,
            ),
            ("kvepp_rejected_requests_total{reason=\"queue_full\"}", 1.0),
        ] {
            assert_eq!(
                kvepp_test_support::find_sample(&text, series),
                Some(want),
                "{series}"
            );
        }
        assert!(text.contains("kvepp_flow_control_queue_wait_seconds_count{priority=\"10\"}"));
        epp.stop().await;
    }
}

/// A queued request keeps the facts it was prepared with: each request's body is parsed, its prompt
/// tokenized and hashed once, however long it waits and however many turns it takes.
#[tokio::test]
async fn a_queued_request_is_parsed_and_tokenized_once() {
    let gate = Gate::start().await;
    let tokenizer =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
    let epp = Epp::start(&manifests(gate.addr), |c| {
        c.max_in_flight_per_endpoint = 1;
        c.engine_metrics.enabled = false;
        c.flow_control.enabled = true;
        c.tokenizers.insert("m".into(), tokenizer);
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let gw = envoy.addr;
    let first = tokio::spawn(async move { ask(gw, "std", "the first request").await });
    wait_for("the endpoint is busy", || async {
        (gate.arrived().len() == 1).then_some(())
    })
    .await;
    // Three requests wait: the first finds the endpoint saturated, the others find it waiting.
    let mut waiting = Vec::new();
    for n in 1..=3 {
        waiting.push(tokio::spawn(async move {
            ask(gw, "std", &format!("queued request number {n}")).await
        }));
        wait_for("queued", || async {
            (queued(&epp, 0).await == f64::from(n)).then_some(())
        })
        .await;
    }
    gate.permits.add_permits(4);
    assert_eq!(first.await.unwrap().status, 200);
    for w in waiting {
        assert_eq!(w.await.unwrap().status, 200);
    }
    assert_eq!(gate.arrived().len(), 4);
    let text = epp.metrics_text().await;
    let step = |s: &str| {
        let series = format!("kvepp_request_preparation_steps_total{{step=\"{s}\"}}");
        kvepp_test_support::find_sample(&text, &series)
    };
    assert_eq!(step("parse"), Some(4.0), "one parse per request");
    assert_eq!(step("tokenize"), Some(4.0), "one tokenization per request");
    assert_eq!(step("hash"), Some(4.0), "one prompt hashing per request");
    assert_eq!(
        kvepp_test_support::find_sample(
            &text,
            "kvepp_flow_control_dequeued_total{outcome=\"dispatched\"}"
        ),
        Some(3.0)
    );
    epp.stop().await;
}

#[tokio::test]
async fn a_request_that_waits_past_the_deadline_gets_503() {
    let gate = Gate::start().await;
    let epp = Epp::start(&manifests(gate.addr), |c| {
        c.max_in_flight_per_endpoint = 1;
        c.engine_metrics.enabled = false;
        c.flow_control.enabled = true;
        c.flow_control.max_wait_ms = 200;
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let gw = envoy.addr;
    let first = tokio::spawn(async move { ask(gw, "std", "first").await });
    wait_for("the endpoint is busy", || async {
        (gate.arrived().len() == 1).then_some(())
    })
    .await;
    let r = ask(gw, "high", "late").await;
    assert_eq!(r.status, 503);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(msg.contains("flow_control.max_wait_ms 200"), "{msg}");
    assert_eq!(
        epp.metric("kvepp_flow_control_dequeued_total{outcome=\"timeout\"}")
            .await,
        Some(1.0)
    );
    gate.permits.add_permits(1);
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(gate.arrived(), ["first"]);
    epp.stop().await;
}

#[tokio::test]
async fn endpoint_scores_only_with_the_flag_and_best_for_the_pick() {
    let addrs = echo_backends(&["a", "b", "c"]).await;
    let text = pool_yaml("pool")
        + &standard_models()
        + &slice_yaml("a", addrs[0], true)
        + &slice_yaml("b", addrs[1], true)
        + &slice_yaml("c", addrs[2], true);
    for flag in [false, true] {
        let epp = Epp::start(&text, |c| {
            c.emit_endpoint_scores = flag;
            c.engine_metrics.enabled = false;
        })
        .await;
        let envoy = Envoy::start(bootstrap(), epp.grpc).await;
        for i in 0..6 {
            let r = post_json(
                envoy.addr,
                format!(r#"{{"model":"m","prompt":"scores {i}"}}"#),
            )
            .await;
            assert_eq!(r.status, 200);
            // The echo backends report the routing headers they got.
            let j = r.json();
            let scores = &j["scores"];
            if !flag {
                assert!(scores.is_null(), "no scores without the flag: {j}");
                continue;
            }
            let scores: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(scores.as_str().expect("scores header")).unwrap();
            assert_eq!(scores.len(), 3, "every candidate: {scores:?}");
            let dest = j["destination"].as_str().unwrap();
            let best = scores
                .values()
                .filter_map(serde_json::Value::as_f64)
                .fold(f64::MIN, f64::max);
            assert_eq!(scores[dest].as_f64(), Some(best), "the pick scores best");
            assert!(scores
                .values()
                .all(|v| (0.0..=1.0).contains(&v.as_f64().unwrap())));
        }
        epp.stop().await;
    }
}

/// `flow_control.ttft_objective_ms` under the predicted-TTFT cost: a request no endpoint could
/// give its first token within the objective even idle is refused at once (it never waits), 503
/// for a standard request and 429 for a sheddable one, with the reason; a request that fits
/// routes. (One that fits only once a queue drains waits behind the others: unit-tested in the
/// dispatcher, measured by bench/overload.sh.)
#[tokio::test]
async fn requests_that_cannot_meet_the_ttft_objective_are_refused_at_once() {
    let gate = Gate::start().await;
    gate.permits.add_permits(8);
    let epp = Epp::start(&manifests(gate.addr), |c| {
        c.engine_metrics.enabled = false;
        c.router.cost_model = kvepp_core::cost::CostModel::PredictedTtft;
        c.flow_control.enabled = true;
        c.flow_control.ttft_objective_ms = 300;
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let gw = envoy.addr;
    // ~30k tokens: over a second of prefill by the model's prior, whatever the queue.
    let long = "x".repeat(120_000);
    for (objective, status) in [("std", 503), ("low", 429)] {
        let r = ask(gw, objective, &long).await;
        assert_eq!(r.status, status, "{objective}: {:?}", r.body);
        let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(
            msg.contains("TTFT objective") && msg.contains("idle, the fastest would take"),
            "{msg}"
        );
    }
    assert!(gate.arrived().is_empty(), "neither reached the engine");
    assert_eq!(
        epp.metric("kvepp_rejected_requests_total{reason=\"ttft_objective\"}")
            .await,
        Some(2.0)
    );
    assert_eq!(
        epp.metric("kvepp_flow_control_dequeued_total{outcome=\"timeout\"}")
            .await
            .unwrap_or(0.0),
        0.0,
        "refused before queueing"
    );
    // A short prompt is predicted well within it.
    let r = ask(gw, "std", "short").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(gate.arrived(), ["short"]);
    epp.stop().await;
}

/// The request's own objectives through Envoy (`x-slo-ttft-ms`, `x-slo-tpot-ms`, under the
/// default whole-request cost and flow control): one no endpoint could meet even idle is refused
/// at once with the objective's reason (503 standard, 429 sheddable), a malformed one is a 400,
/// and one that fits routes.
#[tokio::test]
async fn requests_whose_slo_headers_no_endpoint_can_meet_are_refused_with_the_reason() {
    let gate = Gate::start().await;
    gate.permits.add_permits(8);
    let epp = Epp::start(&manifests(gate.addr), |c| {
        c.engine_metrics.enabled = false;
        c.flow_control.enabled = true;
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let gw = envoy.addr;
    let ask_with = |objective: &'static str, slo: (&'static str, &'static str)| async move {
        let headers = [
            ("content-type", "application/json"),
            ("x-llm-d-inference-objective", objective),
            slo,
        ];
        let body = r#"{"model":"m","prompt":"slo"}"#.to_owned();
        http(gw, "POST", "/v1/completions", &headers, body).await
    };
    // A step is predicted at several ms on any endpoint: a 1 µs TPOT cannot be met.
    for (objective, status) in [("std", 503), ("low", 429)] {
        let r = ask_with(objective, ("x-slo-tpot-ms", "0.001")).await;
        assert_eq!(r.status, status, "{objective}: {:?}", r.body);
        let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(msg.contains("time per output token"), "{msg}");
    }
    let r = ask_with("std", ("x-slo-ttft-ms", "0.001")).await;
    assert_eq!(r.status, 503, "{:?}", r.body);
    let r = ask_with("std", ("x-slo-tpot-ms", "soon")).await;
    assert_eq!(r.status, 400, "{:?}", r.body);
    assert!(gate.arrived().is_empty(), "none reached the engine");
    for (reason, n) in [
        ("tpot_objective", 2.0),
        ("ttft_objective", 1.0),
        ("invalid_slo_header", 1.0),
    ] {
        let m = format!("kvepp_rejected_requests_total{{reason=\"{reason}\"}}");
        assert_eq!(epp.metric(&m).await, Some(n), "{reason}");
    }
    // Objectives an idle endpoint meets: routed.
    let r = ask_with("std", ("x-slo-tpot-ms", "1000")).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let r = ask_with("std", ("x-slo-ttft-ms", "60000")).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(gate.arrived(), ["slo", "slo"]);
    epp.stop().await;
}

/// Scale from zero: with flow control on, requests for a pool with no ready endpoint wait (counted
/// by pool and model for an autoscaler) and the first endpoint to become ready is given them in
/// priority order; when none becomes ready within `max_wait_ms`, 503.
#[tokio::test]
async fn a_pool_at_zero_holds_requests_until_its_first_endpoint_then_serves_them_by_priority() {
    let gate = Gate::start().await;
    let empty = pool_yaml("pool")
        + &standard_models()
        + &objective_yaml("high", 10, "pool")
        + &objective_yaml("std", 0, "pool")
        + &objective_yaml("low", -1, "pool");
    let epp = Epp::start(&empty, |c| {
        c.max_in_flight_per_endpoint = 1;
        c.engine_metrics.enabled = false;
        c.flow_control.enabled = true;
        c.flow_control.max_wait_ms = 9_000;
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let gw = envoy.addr;
    let waiting_series = r#"kvepp_flow_control_waiting_for_endpoints{pool="pool",model="m"}"#;
    let started = tokio::time::Instant::now();
    let mut waiting = Vec::new();
    for (n, (objective, prompt)) in [("low", "low-1"), ("std", "std-1"), ("high", "high-1")]
        .into_iter()
        .enumerate()
    {
        waiting.push(tokio::spawn(
            async move { ask(gw, objective, prompt).await },
        ));
        wait_for("counted as waiting for an endpoint", || async {
            (epp.metric(waiting_series).await == Some(n as f64 + 1.0)).then_some(())
        })
        .await;
    }
    // The first engine becomes ready 2 s after the first request arrived.
    tokio::time::sleep_until(started + std::time::Duration::from_secs(2)).await;
    assert!(gate.arrived().is_empty());
    epp.write_manifest("slice.yaml", &slice_yaml("gate", gate.addr, true));
    for expected in ["high-1", "std-1", "low-1"] {
        wait_for("next request dispatched", || async {
            (gate.arrived().last().map(String::as_str) == Some(expected)).then_some(())
        })
        .await;
        gate.permits.add_permits(1);
    }
    for w in waiting {
        let r = w.await.unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
    assert_eq!(gate.arrived(), ["high-1", "std-1", "low-1"]);
    assert_eq!(epp.metric(waiting_series).await, Some(0.0));
    epp.stop().await;

    // No endpoint ever appears: 503 once the wait is over, saying so.
    let epp = Epp::start(&empty, |c| {
        c.engine_metrics.enabled = false;
        c.flow_control.enabled = true;
        c.flow_control.max_wait_ms = 300;
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let r = ask(envoy.addr, "high", "nobody").await;
    assert_eq!(r.status, 503);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        msg.contains("no endpoint of the pool became ready"),
        "{msg}"
    );
    assert_eq!(
        epp.metric(r#"kvepp_rejected_requests_total{reason="no_ready_endpoints"}"#)
            .await,
        Some(1.0)
    );
    assert_eq!(
        epp.metric(r#"kvepp_flow_control_waiting_for_endpoints{pool="pool",model="m"}"#)
            .await,
        Some(0.0)
    );
    epp.stop().await;
}
