//! Reading what the repository ships: the Kubernetes manifests as YAML documents, and Envoy's
//! verdict on a bootstrap file.

use std::path::Path;
use std::process::Command;

use kvepp::discovery::objects::parse_documents;

use crate::harness::{envoy_bin, repo_root};

/// Every YAML document under `dir` (relative to the repository) as (file name, value); each file
/// must also parse as kvepp's objects, and each document has apiVersion, kind and metadata.name.
pub fn docs(dir: &str) -> Vec<(String, serde_yaml::Value)> {
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
