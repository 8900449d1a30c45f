//! The OpenAPI documents against the served routes, and API fuzzing from them.

use super::*;

/// (METHOD, path) of every operation in an OpenAPI document.
fn documented(doc: &str) -> std::collections::BTreeSet<(String, String)> {
    let v: serde_yaml::Value = serde_yaml::from_str(doc).expect("OpenAPI YAML");
    let mut out = std::collections::BTreeSet::new();
    for (path, item) in v["paths"].as_mapping().expect("paths") {
        for (method, _) in item.as_mapping().expect("path item") {
            let m = method.as_str().unwrap();
            if m != "parameters" {
                out.insert((m.to_uppercase(), path.as_str().unwrap().to_owned()));
            }
        }
    }
    out
}

/// The OpenAPI documents list exactly the routes, and every documented operation is served (no
/// unknown-route 404, no 405) by a live service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_documents_match_the_served_routes() {
    use kvepp::api::{select, slot_tracker};
    for (doc, routes, svc) in [
        (select::OPENAPI, select::ROUTES, select_service(&[]).await),
        (
            slot_tracker::OPENAPI,
            slot_tracker::ROUTES,
            slot_tracker(&[]).await,
        ),
    ] {
        let listed: std::collections::BTreeSet<(String, String)> = routes
            .iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .collect();
        assert_eq!(documented(doc), listed, "document and routes agree");
        for (method, path) in &listed {
            let concrete = path
                .replace("{worker_id}", "1")
                .replace("{reservation_id}", "r");
            let r = call(svc.addr, method, &concrete, json!({})).await;
            assert_ne!(r.status, 405, "{method} {path} is served");
            if r.status == 404 {
                let msg = r.json()["error"].as_str().unwrap_or_default().to_owned();
                assert!(
                    !msg.starts_with("no route"),
                    "{method} {path} is served: {msg}"
                );
            }
        }
        // And an undocumented one is not.
        let r = call(svc.addr, "GET", "/undocumented", Value::Null).await;
        assert_eq!(r.status, 404);
        svc.stop().await;
    }
}

/// Schemathesis (from PyPI, installed into .venv by scripts/test.sh) fuzzes both services from
/// their OpenAPI documents, as real processes: no 5xx, and the process never panics. `GET /ready`
/// is left out: its 503 before any worker is registered is the documented answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_fuzzing_from_the_openapi_documents_finds_no_server_error() {
    let root = kvepp_test_support::harness::repo_root();
    let st = root.join(".venv/bin/schemathesis");
    assert!(st.exists(), "{} missing: run scripts/test.sh", st.display());
    for (sub, doc, seed) in [
        (
            "select-service",
            "src/api/openapi/select-service.yaml",
            r#"{"worker_id": 1, "model_name": "default", "block_size": 16, "data_parallel_size": 2}"#,
        ),
        (
            "slot-tracker",
            "src/api/openapi/slot-tracker.yaml",
            r#"{"worker_id": 1, "model_name": "default", "block_size": 16, "dp_size": 2}"#,
        ),
    ] {
        let port = free_port();
        let log = kvepp_test_support::TempDir::new("fuzz");
        let stderr = std::fs::File::create(log.path().join("stderr")).unwrap();
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvepp"))
            .args([sub, "--port", &port.to_string(), "--host", "127.0.0.1"])
            .env("RUST_LOG", "warn")
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn kvepp");
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        wait_for("the service listening", || async move {
            let ok = tokio::net::TcpStream::connect(addr).await.is_ok();
            ok.then_some(())
        })
        .await;
        let register = if sub == "select-service" {
            "/workers"
        } else {
            "/register"
        };
        assert_eq!(
            call(addr, "POST", register, serde_json::from_str(seed).unwrap())
                .await
                .status,
            201
        );
        let out = tokio::process::Command::new(&st)
            .current_dir(log.path())
            .args([
                "run",
                root.join(doc).to_str().unwrap(),
                "--url",
                &format!("http://{addr}"),
            ])
            .args([
                "--checks",
                "not_a_server_error",
                "--max-examples",
                "25",
                "--seed",
                "7",
            ])
            .args(["--exclude-path", "/ready", "--request-timeout", "5"])
            .env("SCHEMATHESIS_TELEMETRY", "false")
            .output()
            .await
            .expect("run schemathesis");
        let report = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "schemathesis found failures against {sub}:\n{report}"
        );
        let generated = report
            .lines()
            .find(|l| l.contains(" generated"))
            .unwrap_or_default()
            .to_owned();
        assert!(generated.contains("generated"), "{report}");
        println!("{sub}: {}", generated.trim());
        assert!(child.try_wait().unwrap().is_none(), "{sub} still running");
        child.kill().await.unwrap();
        let logged = std::fs::read_to_string(log.path().join("stderr")).unwrap();
        assert!(!logged.contains("panicked"), "{sub} panicked:\n{logged}");
    }
}
