//! What the repository ships besides the manifests' objects: the container recipe and the images
//! it makes (built by `scripts/image.sh` and run here with podman), the Grafana dashboard, and the
//! Envoy bootstrap `kvepp envoy-config` generates.

use std::process::{Command, Stdio};

use kvepp_test_support::container::{image, Podman};
use kvepp_test_support::prelude::*;
use kvepp_test_support::shipped::{docs, envoy_validates, overlays};
use kvepp_test_support::TempDir;

/// The image build makes exactly the workspace's two binaries, locked and static, and puts each
/// in a `FROM scratch` stage with the licence, the CA bundle and a numeric non-root user; the
/// images it tags are exactly those the manifests run.
#[test]
fn container_images_match_the_workspace_and_the_manifests() {
    let root = repo_root();
    let recipe = std::fs::read_to_string(root.join("scripts/Containerfile")).unwrap();
    let script = std::fs::read_to_string(root.join("scripts/image.sh")).unwrap();
    let cargo: toml_like::Manifest = toml_like::read(&root.join("Cargo.toml"));
    let build = script
        .lines()
        .find(|l| l.starts_with("cargo build"))
        .expect("a cargo build step");
    assert!(
        build.contains("--locked") && build.contains("--target \"$target\""),
        "{build}"
    );
    assert!(script.contains("target=x86_64-unknown-linux-musl"));
    let mut built: Vec<&str> = build
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
    // Stages: a scratch base with the licence, CA bundle and user, then one per binary.
    let stages: Vec<(&str, &str)> = recipe
        .split("\nFROM ")
        .skip(1)
        .map(|s| {
            let name = s.lines().next().unwrap().rsplit(' ').next().unwrap();
            (name, s)
        })
        .collect();
    let stage = |name: &str| {
        stages
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("stage {name}"))
            .1
    };
    let base = stage("base");
    assert!(base.starts_with("scratch AS base"), "{base}");
    for needed in [
        "COPY LICENSE /usr/share/licenses/kvepp/LICENSE",
        "COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt",
        "COPY passwd group /etc/",
        "USER 65532:65532",
    ] {
        assert!(base.contains(needed), "base lacks {needed}");
    }
    assert!(script.contains(":65532:65532:"), "a passwd entry for 65532");
    let mut images = Vec::new();
    for (target, bin) in [("epp", "kvepp"), ("worker-agent", "kvepp-agent")] {
        let body = stage(target);
        assert!(body.starts_with(&format!("base AS {target}")), "{body}");
        let copies: Vec<&str> = body.lines().filter(|l| l.starts_with("COPY")).collect();
        assert_eq!(copies, [format!("COPY {bin} /usr/local/bin/{bin}")]);
        assert!(body.contains(&format!("ENTRYPOINT [\"/usr/local/bin/{bin}\"]")));
        images.push(match target {
            "epp" => format!("kvepp/kvepp:{}", cargo.version),
            _ => format!("kvepp/worker-agent:{}", cargo.version),
        });
    }
    assert!(
        !recipe.lines().any(|l| l.starts_with("FROM ")
            && !l.starts_with("FROM scratch")
            && !l.starts_with("FROM base")),
        "no base image from a registry"
    );
    assert!(root.join("LICENSE").is_file());
    // The build script tags those images; the manifests run exactly them.
    assert!(script.contains("epp) image=kvepp/kvepp:$version"));
    assert!(script.contains("worker-agent) image=kvepp/worker-agent:$version"));
    let mut used = std::collections::BTreeSet::new();
    for overlay in overlays() {
        for (_, v) in &docs(&overlay) {
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
    }
    assert_eq!(used, images.into_iter().collect());
}

/// The EPP image as a pod runs it: read-only root filesystem, user 65532, ext_proc and gRPC health
/// served, a request from a real Envoy routed to the endpoint it names, and SIGTERM answered by a
/// clean exit within the shutdown grace. The worker-agent image runs its binary.
#[tokio::test]
async fn the_image_runs_read_only_as_non_root_and_routes_through_envoy() {
    let podman = Podman::new();
    let epp = image("kvepp/kvepp");
    let agent = image("kvepp/worker-agent");
    for i in [&epp, &agent] {
        let user = podman
            .inspect(i, "{{.Config.User}}")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(user, "65532:65532", "{i}");
    }
    let help = podman
        .command([
            "run",
            "--rm",
            "--network",
            "none",
            "--read-only",
            &agent,
            "--help",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        help.status.success(),
        "{}",
        String::from_utf8_lossy(&help.stderr)
    );
    assert!(String::from_utf8_lossy(&help.stdout).contains("--component"));

    let backends = echo_backends(&["a"]).await;
    let dir = TempDir::new("image-pool");
    std::fs::write(
        dir.path().join("pool.yaml"),
        pool_manifests(&[("a", backends[0])]),
    )
    .unwrap();
    let (grpc, health, metrics) = (free_port(), free_port(), free_port());
    let name = format!("kvepp-image-test-{}", std::process::id());
    let (delay_ms, grace_s) = (200u64, 5u64);
    let mut run = podman
        .command([
            "run",
            "--rm",
            "--name",
            &name,
            "--network",
            "host",
            "--read-only",
        ])
        .args(["--user", "65532:65532", "-v"])
        .arg(format!("{}:/pool:ro", dir.path().display()))
        .args([
            &epp,
            "serve",
            "--pool-name",
            "pool",
            "--manifests-dir",
            "/pool",
        ])
        .args(["--bind-address", "127.0.0.1", "--log-format", "json"])
        .args(["--grpc-port", &grpc.to_string()])
        .args(["--grpc-health-port", &health.to_string()])
        .args(["--metrics-port", &metrics.to_string()])
        .args(["--shutdown-delay-ms", &delay_ms.to_string()])
        .args(["--shutdown-grace-seconds", &grace_s.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The container's log, read as it comes (a full pipe would stall it).
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let reader = {
        let log = log.clone();
        let mut stderr = run.stderr.take().unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = std::io::Read::read(&mut stderr, &mut buf) {
                if n == 0 {
                    break;
                }
                log.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        })
    };

    kvepp_test_support::epp::wait_health_serving(health).await;

    let envoy = Envoy::start(bootstrap(), ([127, 0, 0, 1], grpc).into()).await;
    let r = post_json(envoy.addr, r#"{"model":"m","prompt":"from the image"}"#).await;
    assert_eq!(
        r.status,
        200,
        "{}\n{}",
        String::from_utf8_lossy(&r.body),
        envoy.log()
    );
    let j = r.json();
    assert_eq!(j["backend"], "a");
    assert_eq!(
        j["destination"].as_str(),
        Some(backends[0].to_string().as_str())
    );

    let term = podman
        .command(["kill", "--signal", "TERM", &name])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(term.success());
    // It exits by itself within the delay and the grace (plus podman's own teardown).
    let grace = std::time::Duration::from_millis(delay_ms + grace_s * 1000 + 5000);
    let exited = kvepp_test_support::wait_until("the container exits", grace, || {
        let status = run.try_wait().unwrap();
        async move { status }
    })
    .await;
    let exit = exited.unwrap_or_else(|e| {
        panic!(
            "{e}: still running after the grace:\n{}",
            log.lock().unwrap()
        )
    });
    reader.join().unwrap();
    let log = log.lock().unwrap().clone();
    assert!(exit.success(), "exit {exit:?}\n{log}");
    assert!(
        log.contains("SIGTERM received") && log.contains("shutdown complete"),
        "{log}"
    );
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
    let flow = kvepp::admission::flow::FlowMetrics::default();
    m.add(&flow);
    flow.queue_size.get_or_create(&p).set(1);
    flow.queue_wait.get_or_create(&p).observe(0.1);
    flow.outcomes
        .get_or_create(&OutcomeLabels {
            outcome: "dispatched",
        })
        .inc();
    // Session and adapter affinity register their own counters.
    let affinity = kvepp::routing::Affinity::default();
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
    // The dashboard's panels are all there.
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

/// GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces as hyphens.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks).
fn anchors(text: &str) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    let mut code = false;
    for line in text.lines() {
        if line.starts_with("```") {
            code = !code;
        } else if !code && line.starts_with('#') {
            out.insert(anchor(line.trim_start_matches('#')));
        }
    }
    out
}

/// Relative links `[..](target)` of a Markdown text, outside code blocks.
fn relative_links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut code = false;
    for line in text.lines() {
        if line.starts_with("```") {
            code = !code;
            continue;
        }
        if code {
            continue;
        }
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            let target = &after[..end];
            if !target.contains("://") && !target.starts_with("mailto:") {
                out.push(target.to_owned());
            }
            rest = &after[end..];
        }
    }
    out
}

/// The README stays an overview of a few screens that links every page under `docs/`, and every
/// relative link of the README and the pages names a file of the repository and, with `#`, one of
/// its headings.
#[test]
fn documentation_links_resolve() {
    let root = repo_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    assert!(
        readme.len() <= 12 * 1024,
        "README.md is {} bytes: reference material belongs in docs/",
        readme.len()
    );
    let mut pages: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    let readme_links = relative_links(&readme);
    for page in &pages {
        let name = format!("docs/{}", page.file_name().unwrap().to_string_lossy());
        assert!(
            readme_links
                .iter()
                .any(|l| l.split('#').next() == Some(name.as_str())),
            "README.md does not link {name}"
        );
    }
    let mut checked = 0;
    for file in std::iter::once(root.join("README.md")).chain(pages.iter().cloned()) {
        let text = std::fs::read_to_string(&file).unwrap();
        let dir = file.parent().unwrap();
        for link in relative_links(&text) {
            let (path, fragment) = link.split_once('#').unwrap_or((link.as_str(), ""));
            let target = if path.is_empty() {
                file.clone()
            } else {
                dir.join(path)
            };
            assert!(
                target.exists(),
                "{}: link {link}: no {}",
                file.display(),
                target.display()
            );
            if !fragment.is_empty() {
                let headings = anchors(&std::fs::read_to_string(&target).unwrap());
                assert!(
                    headings.contains(fragment),
                    "{}: link {link}: no heading #{fragment} in {}",
                    file.display(),
                    target.display()
                );
            }
            checked += 1;
        }
    }
    assert!(checked > pages.len(), "links were found and checked");
}
