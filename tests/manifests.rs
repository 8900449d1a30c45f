//! Every shipped manifest is checked the way `kubectl apply --dry-run=client` would: it parses,
//! names its kind, and what kvepp itself reads is valid for kvepp.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use kvepp::discovery::objects::parse_documents;
use kvepp::discovery::{Datastore, Inventory, PoolRef};

fn docs(dir: &str) -> Vec<(String, serde_yaml::Value)> {
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(repo_root().join(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for f in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "yaml"))
    {
        let text = std::fs::read(f).unwrap();
        parse_documents(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        for d in serde_yaml::Deserializer::from_slice(&text) {
            let v: serde_yaml::Value = serde::Deserialize::deserialize(d)
                .unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            if v.is_null() {
                continue;
            }
            let name = f.file_name().unwrap().to_string_lossy().to_string();
            for key in ["apiVersion", "kind"] {
                assert!(
                    v[key].as_str().is_some_and(|s| !s.is_empty()),
                    "{name}: {key} missing"
                );
            }
            assert!(
                v["metadata"]["name"].as_str().is_some(),
                "{name}: metadata.name missing"
            );
            out.push((name, v));
        }
    }
    out
}

fn find<'a>(docs: &'a [(String, serde_yaml::Value)], kind: &str) -> Vec<&'a serde_yaml::Value> {
    docs.iter()
        .filter(|(_, v)| v["kind"] == kind)
        .map(|(_, v)| v)
        .collect()
}

#[test]
fn kubernetes_manifests_are_consistent() {
    let d = docs("manifests/kubernetes");
    // RBAC: read-only, on exactly the resources kvepp watches.
    let role = find(&d, "Role")[0];
    let mut resources = Vec::new();
    for rule in role["rules"].as_sequence().unwrap() {
        let verbs: Vec<&str> = rule["verbs"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(verbs, ["get", "list", "watch"], "least privilege");
        for r in rule["resources"].as_sequence().unwrap() {
            resources.push(format!(
                "{}/{}",
                rule["apiGroups"][0].as_str().unwrap(),
                r.as_str().unwrap()
            ));
        }
    }
    resources.sort();
    assert_eq!(
        resources,
        [
            "discovery.k8s.io/endpointslices",
            "inference.networking.k8s.io/inferencepools",
            "inference.networking.x-k8s.io/inferencemodels",
            "inference.networking.x-k8s.io/inferencepools",
        ]
    );
    // The Deployment's flags exist, its ports and probes match the server.
    let dep = find(&d, "Deployment")[0];
    let c = &dep["spec"]["template"]["spec"]["containers"][0];
    let help = String::from_utf8(
        Command::new(env!("CARGO_BIN_EXE_kvepp"))
            .args(["serve", "--help"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    for arg in c["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .filter(|a| a.starts_with("--"))
    {
        assert!(help.contains(arg), "{arg} is not a flag of `kvepp serve`");
    }
    let ports: Vec<u64> = c["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| p["containerPort"].as_u64().unwrap())
        .collect();
    assert_eq!(ports, [9002, 9003, 9090]);
    assert_eq!(c["readinessProbe"]["grpc"]["service"], "readiness");
    assert_eq!(c["livenessProbe"]["grpc"]["service"], "liveness");
    // The config file in the ConfigMap is a valid kvepp configuration (but for the mounted dir).
    let cm = find(&d, "ConfigMap")
        .into_iter()
        .find(|m| m["metadata"]["name"] == "kvepp-config")
        .unwrap();
    let mut cfg: kvepp::config::Config =
        serde_yaml::from_str(cm["data"]["kvepp.yaml"].as_str().unwrap()).unwrap();
    cfg.manifests_dir = Some(std::env::temp_dir());
    cfg.validate().unwrap();
    // The pool's extensionRef is the kvepp Service, and its headless Service is named like it.
    let pool = find(&d, "InferencePool")[0];
    let svc_names: Vec<&str> = find(&d, "Service")
        .iter()
        .map(|s| s["metadata"]["name"].as_str().unwrap())
        .collect();
    assert!(svc_names.contains(&pool["spec"]["extensionRef"]["name"].as_str().unwrap()));
    assert!(svc_names.contains(&pool["metadata"]["name"].as_str().unwrap()));
    for m in find(&d, "InferenceModel") {
        assert_eq!(m["spec"]["poolRef"]["name"], pool["metadata"]["name"]);
    }
    let route = find(&d, "HTTPRoute")[0];
    assert_eq!(
        route["spec"]["rules"][0]["backendRefs"][0]["name"],
        pool["metadata"]["name"]
    );
}

#[test]
fn local_example_gives_a_ready_pool() {
    let store = Datastore::new(
        PoolRef {
            name: "demo-pool".into(),
            namespace: "default".into(),
            service: "demo-pool".into(),
        },
        |_| {},
    );
    let mut objects = Vec::new();
    for f in ["examples/local/pool.yaml", "examples/local/models.yaml"] {
        objects.extend(parse_documents(&std::fs::read(repo_root().join(f)).unwrap()).unwrap());
    }
    docs("examples/local");
    store.apply(&Inventory { objects });
    let snap = store.snapshot();
    let eps: Vec<&str> = snap.endpoints.iter().map(|e| &*e.addr_str).collect();
    assert_eq!(
        eps,
        ["127.0.0.1:18001", "127.0.0.1:18002"],
        "model-server-c is not ready"
    );
    assert_eq!(snap.models.len(), 3);
}

#[test]
fn envoy_bootstrap_validates() {
    let path = repo_root().join("manifests/envoy/envoy-local.yaml");
    assert!(Path::new(&path).exists());
    let out = Command::new(envoy_bin())
        .args(["--mode", "validate", "-c"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The facts the protocol depends on are in the shipped file.
    let b = bootstrap();
    let ext = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"][0]["typed_config"]
        .clone();
    assert_eq!(
        ext["metadata_options"]["receiving_namespaces"]["untyped"][0],
        "envoy.lb"
    );
    assert_eq!(ext["processing_mode"]["request_trailer_mode"], "SEND");
    let pool = b["static_resources"]["clusters"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "inference_pool")
        .unwrap()
        .clone();
    assert_eq!(pool["type"], "ORIGINAL_DST");
    assert_eq!(
        pool["original_dst_lb_config"]["http_header_name"],
        "x-gateway-destination-endpoint"
    );
}
