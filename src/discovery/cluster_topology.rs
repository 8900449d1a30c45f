//! Grove's `ClusterTopology` (`grove.io/v1alpha1`, cluster-scoped): the ordered topology levels
//! (broadest first) a cluster's KV-transfer constraint may name, and the design document's
//! admission checks, which kvepp runs when it starts with `cluster_topology` and a
//! `kv_transfer_topology_level` configured (there is no webhook in front of kvepp's
//! configuration, so a bad level stops the start instead of being admitted):
//!
//! | case | outcome |
//! |---|---|
//! | Grove not installed (the ClusterTopology API is not served) | start refused |
//! | the named ClusterTopology does not exist | start refused |
//! | the level is not one of its `spec.levels[].domain` | start refused |
//!
//! Without `cluster_topology` none of this applies (the design's explicit-label path): the level
//! is taken as given.

use std::path::Path;

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};
use serde::Deserialize;

pub(crate) const API_VERSION: &str = "grove.io/v1alpha1";

/// One level of a ClusterTopology.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Level {
    pub domain: String,
    #[serde(default)]
    pub label_key: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterTopology {
    pub name: String,
    /// Broadest first.
    pub levels: Vec<Level>,
}

#[derive(Deserialize)]
struct Wire {
    metadata: Meta,
    #[serde(default)]
    spec: Spec,
}

#[derive(Deserialize)]
struct Meta {
    name: String,
}

#[derive(Deserialize, Default)]
struct Spec {
    #[serde(default)]
    levels: Vec<Level>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TopologyCheckError {
    #[error("cluster_topology {name:?}: Grove is not installed (the {API_VERSION} ClusterTopology API is not served), so kv_transfer_topology_level {level:?} cannot be checked")]
    GroveNotInstalled { name: String, level: String },
    #[error("cluster_topology {name:?}: no such ClusterTopology, so kv_transfer_topology_level {level:?} cannot be checked")]
    NotFound { name: String, level: String },
    #[error("kv_transfer_topology_level {level:?} is not a level of ClusterTopology {name:?} (its levels: {})", .levels.join(", "))]
    UnknownLevel {
        name: String,
        level: String,
        levels: Vec<String>,
    },
    #[error("cluster_topology {name:?}: {message}")]
    Read { name: String, message: String },
}

/// What the cluster holds: `None` when the ClusterTopology API is not served (Grove missing).
pub type Found = Option<Vec<ClusterTopology>>;

/// The admission checks: the named topology exists and has `level`. Returns its levels'
/// domains, broadest first.
pub(crate) fn check(
    found: &Found,
    name: &str,
    level: &str,
) -> Result<Vec<String>, TopologyCheckError> {
    let owned = || (name.to_owned(), level.to_owned());
    let Some(all) = found else {
        let (name, level) = owned();
        return Err(TopologyCheckError::GroveNotInstalled { name, level });
    };
    let Some(t) = all.iter().find(|t| t.name == name) else {
        let (name, level) = owned();
        return Err(TopologyCheckError::NotFound { name, level });
    };
    let levels: Vec<String> = t.levels.iter().map(|l| l.domain.clone()).collect();
    if !levels.iter().any(|l| l == level) {
        let (name, level) = owned();
        return Err(TopologyCheckError::UnknownLevel {
            name,
            level,
            levels,
        });
    }
    Ok(levels)
}

fn parse(value: serde_json::Value) -> Result<ClusterTopology, serde_json::Error> {
    let w: Wire = serde_json::from_value(value)?;
    Ok(ClusterTopology {
        name: w.metadata.name,
        levels: w.spec.levels,
    })
}

/// The ClusterTopologies of a manifests directory (`*.yaml`, `*.yml`, `*.json`). A directory
/// stands in for a whole cluster, so one without any counts as "Grove not installed".
pub(crate) fn from_manifests(dir: &Path) -> Result<Found, std::io::Error> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if !matches!(ext, "yaml" | "yml" | "json") {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let Ok(v) = serde_json::Value::deserialize(doc) else {
                continue;
            };
            if v["apiVersion"] == API_VERSION && v["kind"] == "ClusterTopology" {
                match parse(v) {
                    Ok(t) => found.push(t),
                    Err(e) => {
                        tracing::warn!(file = %path.display(), error = %e, "invalid ClusterTopology ignored")
                    }
                }
            }
        }
    }
    Ok((!found.is_empty()).then_some(found))
}

/// The cluster's ClusterTopologies through the Kubernetes API (`None`: the API answers 404, the
/// CRD is not installed).
pub(crate) async fn from_cluster(client: kube::Client) -> Result<Found, kube::Error> {
    let gvk = GroupVersionKind::gvk("grove.io", "v1alpha1", "ClusterTopology");
    let res = ApiResource::from_gvk_with_plural(&gvk, "clustertopologies");
    let api: Api<DynamicObject> = Api::all_with(client, &res);
    match api.list(&ListParams::default()).await {
        Ok(list) => Ok(Some(
            list.items
                .into_iter()
                .filter_map(|o| {
                    let v = serde_json::to_value(o).ok()?;
                    parse(v).ok()
                })
                .collect(),
        )),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topology() -> Found {
        Some(vec![ClusterTopology {
            name: "my-cluster-topology".into(),
            levels: ["zone", "rack", "host"]
                .map(|d| Level {
                    domain: d.into(),
                    label_key: String::new(),
                })
                .to_vec(),
        }])
    }

    #[test]
    fn the_design_documents_admission_table() {
        assert_eq!(
            check(&topology(), "my-cluster-topology", "rack").unwrap(),
            ["zone", "rack", "host"]
        );
        assert!(matches!(
            check(&None, "my-cluster-topology", "zone"),
            Err(TopologyCheckError::GroveNotInstalled { .. })
        ));
        assert!(matches!(
            check(&topology(), "other", "zone"),
            Err(TopologyCheckError::NotFound { .. })
        ));
        let err = check(&topology(), "my-cluster-topology", "block").unwrap_err();
        assert!(matches!(err, TopologyCheckError::UnknownLevel { .. }));
        assert!(err.to_string().contains("zone, rack, host"), "{err}");
    }

    #[test]
    fn reads_cluster_topologies_from_a_manifests_directory() {
        let dir = kvepp_test_support::TempDir::new("cluster-topology");
        assert_eq!(from_manifests(dir.path()).unwrap(), None);
        std::fs::write(
            dir.path().join("topology.yaml"),
            "apiVersion: grove.io/v1alpha1\nkind: ClusterTopology\nmetadata: {name: t}\nspec:\n  levels:\n  - {domain: zone, labelKey: topology.kubernetes.io/zone}\n  - {domain: host, labelKey: kubernetes.io/hostname}\n---\nkind: Other\n",
        )
        .unwrap();
        let found = from_manifests(dir.path()).unwrap();
        assert_eq!(check(&found, "t", "host").unwrap(), ["zone", "host"]);
        assert_eq!(
            found.unwrap()[0].levels[0].label_key,
            "topology.kubernetes.io/zone"
        );
    }
}
