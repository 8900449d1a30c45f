//! What the repository ships besides the manifests' objects: the container recipe and the images
//! it makes, the Grafana dashboard, and the Envoy bootstrap `kvepp envoy-config` generates.
// Test code: a failed expectation is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use kvepp_test_support::prelude::*;
use kvepp_test_support::shipped::{docs, envoy_validates};

/// The container recipe builds exactly the workspace's two binaries, locked, runs them as a
/// numeric non-root user on a minimal base with only the binary and the licence, and the images it
/// makes are exactly those the manifests run. (No container engine here: checked statically.)
#[test]
fn container_images_match_the_workspace_and_the_manifests() {
    let root = repo_root();
    let recipe = std::fs::read_to_string(root.join("Containerfile")).unwrap();
    let cargo: toml_like::Manifest = toml_like::read(&root.join("Cargo.toml"));
    let run = recipe
        .lines()
        .find(|l| l.starts_with("RUN cargo build"))
        .expect("a cargo build step");
    assert!(
        run.contains("--release") && run.contains("--locked"),
        "{run}"
    );
    let mut built: Vec<&str> = run
        .split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[0] == "--bin")
        .map(|w| w[1])
        .collect();
    built.sort();
    let mut bins = cargo.bins.clone();
    bins.sort();
    assert_eq!(built, bins, "every [[bin]] of the workspace, nothing else");
    // Final stages: one per binary, each with its binary, the licence, a numeric non-root user.
    let stages: Vec<(&str, &str)> = recipe
        .split("\nFROM ")
        .skip(1)
        .map(|s| {
            let name = s.lines().next().unwrap().rsplit(' ').next().unwrap();
            (name, s)
        })
        .collect();
    let mut images = Vec::new();
    for (target, bin) in [("epp", "kvepp"), ("worker-agent", "kvepp-agent")] {
        let (_, body) = stages
            .iter()
            .find(|(n, _)| *n == target)
            .unwrap_or_else(|| panic!("stage {target}"));
        assert!(
            body.starts_with("${RUNTIME_IMAGE}"),
            "{target}: minimal runtime base"
        );
        let copies: Vec<&str> = body.lines().filter(|l| l.starts_with("COPY")).collect();
        assert_eq!(
            copies.len(),
            2,
            "{target}: only the binary and the licence: {copies:?}"
        );
        assert!(
            copies[0].contains(&format!("/src/target/release/{bin} ")),
            "{copies:?}"
        );
        assert!(copies[1].starts_with("COPY LICENSE "), "{copies:?}");
        let user = body
            .lines()
            .find_map(|l| l.strip_prefix("USER "))
            .expect("USER");
        let uid: u32 = user
            .split(':')
            .next()
            .unwrap()
            .parse()
            .expect("numeric user");
        assert_ne!(uid, 0, "non-root");
        assert!(body.contains(&format!("ENTRYPOINT [\"/usr/local/bin/{bin}\"]")));
        images.push(match target {
            "epp" => format!("kvepp/kvepp:{}", cargo.version),
            _ => format!("kvepp/worker-agent:{}", cargo.version),
        });
    }
    assert!(recipe.contains("ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot"));
    assert!(root.join("LICENSE").is_file());
    // The build script tags those images; the manifests run exactly them.
    let script = std::fs::read_to_string(root.join("scripts/image.sh")).unwrap();
    assert!(script.contains("epp) image=kvepp/kvepp:$version"));
    assert!(script.contains("worker-agent) image=kvepp/worker-agent:$version"));
    let d = docs("manifests/kubernetes");
    let mut used = std::collections::BTreeSet::new();
    for (_, v) in &d {
        for c in v["spec"]["template"]["spec"]["containers"]
            .as_sequence()
            .into_iter()
            .flatten()
        {
            let image = c["image"].as_str().unwrap();
            if image.starts_with("kvepp/") {
                used.insert(image.to_owned());
            }
        }
    }
    assert_eq!(used, images.into_iter().collect());
}

/// Just enough of Cargo.toml: the package version and the `[[bin]]` names.
mod toml_like {
    pub struct Manifest {
        pub version: String,
        pub bins: Vec<String>,
    }

    pub fn read(path: &std::path::Path) -> Manifest {
        let text = std::fs::read_to_string(path).unwrap();
        let value = |l: &str| l.split('"').nth(1).unwrap().to_owned();
        let version = text
            .lines()
            .find(|l| l.starts_with("version = "))
            .map(value)
            .unwrap();
        let mut bins = Vec::new();
        let mut in_bin = false;
        for l in text.lines() {
            if l.starts_with('[') {
                in_bin = l == "[[bin]]";
            } else if in_bin && l.starts_with("name = ") {
                bins.push(value(l));
            }
        }
        Manifest { version, bins }
    }
}

/// Every metric the Grafana dashboard queries is one kvepp exports, with the suffix its type has
/// (`_total` counters, `_bucket`/`_sum`/`_count` histograms, plain gauges).
#[test]
fn grafana_dashboard_queries_only_exported_metrics() {
    let text = std::fs::read_to_string(repo_root().join("manifests/grafana/kvepp.json")).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).expect("dashboard JSON");
    // Labelled families are exported once they have a series: give each one a series, as traffic
    // would (the names and types are what is checked).
    use kvepp::metrics::*;
    let m = Metrics::new();
    let ep = EndpointLabels {
        endpoint: "10.0.0.1:8000".into(),
    };
    m.requests
        .get_or_create(&RequestLabels {
            model: "m".into(),
            target_model: "m".into(),
            endpoint: ep.endpoint.clone(),
            code: Outcome::Status(200),
        })
        .inc();
    m.rejected
        .get_or_create(&ReasonLabels {
            reason: "saturated",
        })
        .inc();
    m.endpoint_in_flight.get_or_create(&ep).set(1);
    m.count_prefix_blocks("tokens", 4, 2);
    // Discovery and the engine readers register their own counters.
    m.add(&kvepp::discovery::DiscoveryCounters::default());
    let engines = kvepp::engine::EngineCounters::default();
    m.add(&engines);
    engines.metadata_missing.get_or_create(&ep).set(0);
    // KV-event ingestion registers its own counters.
    let kv = kvepp::kv_events::apply::KvEventMetrics::default();
    m.add(&kv);
    kv.batches.get_or_create(&ep).inc();
    let p = PriorityLabels { priority: 0 };
    // Flow control registers its own counters.
    let flow = kvepp::request::flow::FlowMetrics::default();
    m.add(&flow);
    flow.queue_size.get_or_create(&p).set(1);
    flow.queue_wait.get_or_create(&p).observe(0.1);
    flow.outcomes
        .get_or_create(&OutcomeLabels {
            outcome: "dispatched",
        })
        .inc();
    // Session and adapter affinity register their own counters.
    let affinity = kvepp::request::Affinity::default();
    m.add(&affinity);
    affinity.count(
        Some(kvepp_core::affinity::SessionOutcome::Hit),
        Some(kvepp_core::affinity::AdapterFit::Loaded),
    );
    // Live reconfiguration and the trace exporter register theirs.
    let reloads = kvepp::server::reload::ReloadMetrics::default();
    m.add(&reloads);
    for f in [&reloads.config, &reloads.tls] {
        f.get_or_create(&ResultLabels { result: "applied" }).inc();
    }
    let traces = kvepp::telemetry::TraceMetrics::default();
    m.add(&traces);
    traces
        .dropped
        .get_or_create(&ReasonLabels {
            reason: "queue_full",
        })
        .inc();
    let exported = m.encode();
    let types: std::collections::HashMap<&str, &str> = exported
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .collect();
    let mut exprs = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            exprs.push(t["expr"].as_str().unwrap().to_owned());
        }
    }
    exprs.push(
        dash["templating"]["list"][1]["query"]
            .as_str()
            .unwrap()
            .to_owned(),
    );
    let mut names = std::collections::BTreeSet::new();
    for e in &exprs {
        let mut rest = e.as_str();
        while let Some(i) = rest.find("kvepp_") {
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            names.insert(tail[..end].to_owned());
            rest = &tail[end..];
        }
    }
    assert!(names.len() >= 14, "{names:?}");
    for name in &names {
        let (family, want) = [
            ("_total", "counter"),
            ("_bucket", "histogram"),
            ("_sum", "histogram"),
            ("_count", "histogram"),
        ]
        .iter()
        .find_map(|(suffix, ty)| name.strip_suffix(suffix).map(|f| (f, *ty)))
        .unwrap_or((name.as_str(), "gauge"));
        assert_eq!(
            types.get(family).copied(),
            Some(want),
            "{name}: the dashboard queries a metric kvepp does not export as a {want}"
        );
    }
    // The panels are all there.
    let titles: Vec<&str> = dash["panels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["title"].as_str().unwrap())
        .collect();
    for want in [
        "Requests by status code",
        "Rejections by reason",
        "Pick latency",
        "Ready endpoints",
        "In flight per endpoint",
        "Prefix-cache hit ratio by mode",
        "KV-event health",
        "Flow control: queue length by priority",
        "Flow control: wait time by priority",
    ] {
        assert!(titles.contains(&want), "{want} missing: {titles:?}");
    }
}

/// `kvepp envoy-config` turns the pool's failureMode into Envoy's: FailOpen allows failure and adds
/// the fallback route over the pool's ready endpoints, FailClose does not; both validate in Envoy.
#[test]
fn envoy_config_follows_the_pools_failure_mode() {
    for (mode, allow) in [("FailOpen", true), ("FailClose", false)] {
        let dir = kvepp_test_support::TempDir::new("envoy-config");
        let pool = format!("apiVersion: inference.networking.k8s.io/v1\nkind: InferencePool\nmetadata: {{name: pool}}\nspec:\n  selector: {{matchLabels: {{app: test}}}}\n  targetPorts: [{{number: 8000}}]\n  endpointPickerRef: {{name: kvepp, port: {{number: 9002}}, failureMode: {mode}}}\n");
        let text = pool + &slice_yaml("a", "127.0.0.1:18000".parse().unwrap(), true);
        std::fs::write(dir.path().join("pool.yaml"), text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_kvepp"))
            .args(["envoy-config", "--pool-name", "pool", "--grpc-port", "9102"])
            .arg("--manifests-dir")
            .arg(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let yaml = String::from_utf8(out.stdout).unwrap();
        let b: serde_yaml::Value = serde_yaml::from_str(&yaml).unwrap();
        let ext = &b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            ["typed_config"]["http_filters"][0]["typed_config"];
        assert_eq!(ext["failure_mode_allow"], allow, "{mode}");
        assert_eq!(yaml.contains("pool_fallback"), allow, "{mode}");
        assert_eq!(
            yaml.contains("port_value: 18000"),
            allow,
            "fallback endpoints"
        );
        assert!(yaml.contains("port_value: 9102"));
        let file = dir.path().join("envoy.yaml");
        std::fs::write(&file, &yaml).unwrap();
        envoy_validates(&file);
    }
}
