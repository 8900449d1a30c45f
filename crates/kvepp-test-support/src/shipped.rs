//! Reading what the repository ships: the Kubernetes manifests as YAML documents (Kustomize
//! overlays rendered by `kubectl kustomize`), and Envoy's verdict on a bootstrap file.

use std::path::Path;
use std::process::Command;

use kvepp::discovery::objects::parse_documents;

use crate::harness::{envoy_bin, repo_root};

/// The Kustomize overlays the repository ships (directories under `manifests/kubernetes/overlays`),
/// relative to the repository, sorted.
pub fn overlays() -> Vec<String> {
    let dir = repo_root().join(OVERLAYS);
    let mut out: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .map(|name| format!("{OVERLAYS}/{name}"))
        .collect();
    out.sort();
    out
}

const OVERLAYS: &str = "manifests/kubernetes/overlays";

/// What `kubectl kustomize dir` renders (`dir` relative to the repository).
pub fn kustomize(dir: &str) -> Vec<u8> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(repo_root().join(dir))
        .output()
        .unwrap_or_else(|e| panic!("kubectl (with Kustomize) is needed to render {dir}: {e}"));
    assert!(
        out.status.success(),
        "kubectl kustomize {dir}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Every YAML document of `dir` (relative to the repository) as (source, value): rendered with
/// `kubectl kustomize` when `dir` is a Kustomization (source `dir: Kind/name`), else each `*.yaml`
/// file of it (source: the file name). Each source must also parse as kvepp's objects, and each
/// document has apiVersion, kind and metadata.name.
pub fn docs(dir: &str) -> Vec<(String, serde_yaml::Value)> {
    let root = repo_root().join(dir);
    let rendered = root.join("kustomization.yaml").is_file();
    let sources: Vec<(String, Vec<u8>)> = if rendered {
        vec![(dir.to_owned(), kustomize(dir))]
    } else {
        let mut files: Vec<_> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|f| f.extension().is_some_and(|e| e == "yaml"))
            .collect();
        files.sort();
        files
            .iter()
            .map(|f| {
                let name = f.file_name().unwrap().to_string_lossy().to_string();
                (name, std::fs::read(f).unwrap())
            })
            .collect()
    };
    let mut out = Vec::new();
    for (source, text) in sources {
        parse_documents(&text).unwrap_or_else(|e| panic!("{source}: {e}"));
        for d in serde_yaml::Deserializer::from_slice(&text) {
            let v: serde_yaml::Value =
                serde::Deserialize::deserialize(d).unwrap_or_else(|e| panic!("{source}: {e}"));
            if v.is_null() {
                continue;
            }
            for key in ["apiVersion", "kind"] {
                assert!(
                    v[key].as_str().is_some_and(|s| !s.is_empty()),
                    "{source}: {key} missing"
                );
            }
            let name = v["metadata"]["name"]
                .as_str()
                .unwrap_or_else(|| panic!("{source}: metadata.name missing"));
            let label = if rendered {
                format!(
                    "{source}: {}/{name}",
                    v["kind"].as_str().unwrap_or_default()
                )
            } else {
                source.clone()
            };
            out.push((label, v));
        }
    }
    out
}

/// `envoy --mode validate -c path` succeeds.
pub fn envoy_validates(path: &Path) {
    let out = Command::new(envoy_bin())
        .args(["--mode", "validate", "-c"])
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}
