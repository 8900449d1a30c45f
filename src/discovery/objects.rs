//! The Kubernetes objects kvepp reads, reduced to the fields it uses, and their conversion into the
//! datastore's model. Both the manifests directory and the Kubernetes watcher produce these.

use std::collections::BTreeMap;

use serde::Deserialize;

pub const GROUP_V1ALPHA2: &str = "inference.networking.x-k8s.io/v1alpha2";
pub const GROUP_V1: &str = "inference.networking.k8s.io/v1";
pub const DISCOVERY_V1: &str = "discovery.k8s.io/v1";
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("{kind} {name:?}: {message}")]
    Invalid {
        kind: &'static str,
        name: String,
        message: String,
    },
    #[error("{kind} has unsupported apiVersion {api_version:?} (expected {expected})")]
    ApiVersion {
        kind: &'static str,
        api_version: String,
        expected: &'static str,
    },
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
pub struct ObjectMeta {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// An InferencePool of either API version, normalised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InferencePool {
    pub name: String,
    pub namespace: Option<String>,
    pub selector: BTreeMap<String, String>,
    pub target_port: u16,
}

/// An InferenceModel (v1alpha2), normalised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InferenceModel {
    pub name: String,
    pub namespace: Option<String>,
    pub model_name: String,
    pub criticality: kvepp_core::Criticality,
    pub pool_ref: String,
    /// (name, weight); weights default to 1 when none is given.
    pub target_models: Vec<(String, u64)>,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct EndpointSlice {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub address_type: Option<String>,
    #[serde(default)]
    pub endpoints: Vec<SliceEndpoint>,
    #[serde(default)]
    pub ports: Option<Vec<SlicePort>>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SliceEndpoint {
    #[serde(default)]
    pub addresses: Vec<String>,
    #[serde(default)]
    pub conditions: Conditions,
    #[serde(default)]
    pub target_ref: Option<ObjectReference>,
    #[serde(default)]
    pub zone: Option<String>,
    #[serde(default)]
    pub node_name: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
pub struct Conditions {
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
}

impl Conditions {
    /// Kubernetes semantics: a nil `ready` means ready; terminating endpoints never take new work.
    pub fn is_ready(&self) -> bool {
        self.ready != Some(false) && self.terminating != Some(true)
    }
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
pub struct ObjectReference {
    #[serde(default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub namespace: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
pub struct SlicePort {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub port: Option<i32>,
}

/// One parsed object of a kind kvepp cares about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Object {
    Pool(InferencePool),
    Model(InferenceModel),
    Slice(EndpointSlice),
}

// ---- wire shapes of the inference CRDs ----

#[derive(Deserialize)]
struct Wire<S> {
    #[serde(default)]
    metadata: ObjectMeta,
    spec: S,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PoolSpecV1Alpha2 {
    #[serde(default)]
    selector: BTreeMap<String, String>,
    target_port_number: i64,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PoolSpecV1 {
    #[serde(default)]
    selector: LabelSelector,
    #[serde(default)]
    target_ports: Vec<PortNumber>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct LabelSelector {
    #[serde(default)]
    match_labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct PortNumber {
    number: i64,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ModelSpecWire {
    model_name: String,
    #[serde(default)]
    criticality: Option<String>,
    pool_ref: NameRef,
    #[serde(default)]
    target_models: Vec<TargetModelWire>,
}

#[derive(Deserialize)]
struct NameRef {
    name: String,
}

#[derive(Deserialize)]
struct TargetModelWire {
    name: String,
    #[serde(default)]
    weight: Option<i64>,
}

fn invalid(kind: &'static str, name: &str, message: impl Into<String>) -> ObjectError {
    ObjectError::Invalid {
        kind,
        name: name.to_owned(),
        message: message.into(),
    }
}

fn port(kind: &'static str, name: &str, n: i64) -> Result<u16, ObjectError> {
    u16::try_from(n)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| invalid(kind, name, format!("target port {n} is not in 1..=65535")))
}

/// Converts one YAML document. `Ok(None)` for kinds kvepp does not use (Service, Deployment, …).
pub fn from_value(value: serde_yaml::Value) -> Result<Option<Object>, ObjectError> {
    let kind = value
        .get("kind")
        .and_then(|k| k.as_str())
        .unwrap_or_default()
        .to_owned();
    let api = value
        .get("apiVersion")
        .and_then(|k| k.as_str())
        .unwrap_or_default()
        .to_owned();
    match kind.as_str() {
        "InferencePool" => pool(api, value).map(|p| Some(Object::Pool(p))),
        "InferenceModel" => {
            if api != GROUP_V1ALPHA2 {
                return Err(ObjectError::ApiVersion {
                    kind: "InferenceModel",
                    api_version: api,
                    expected: GROUP_V1ALPHA2,
                });
            }
            model(value).map(|m| Some(Object::Model(m)))
        }
        "EndpointSlice" => {
            if api != DISCOVERY_V1 {
                return Err(ObjectError::ApiVersion {
                    kind: "EndpointSlice",
                    api_version: api,
                    expected: DISCOVERY_V1,
                });
            }
            Ok(Some(Object::Slice(serde_yaml::from_value(value)?)))
        }
        _ => Ok(None),
    }
}

fn pool(api: String, value: serde_yaml::Value) -> Result<InferencePool, ObjectError> {
    const K: &str = "InferencePool";
    match api.as_str() {
        GROUP_V1ALPHA2 => {
            let w: Wire<PoolSpecV1Alpha2> = serde_yaml::from_value(value)?;
            let target_port = port(K, &w.metadata.name, w.spec.target_port_number)?;
            Ok(InferencePool {
                name: w.metadata.name,
                namespace: w.metadata.namespace,
                selector: w.spec.selector,
                target_port,
            })
        }
        GROUP_V1 => {
            let w: Wire<PoolSpecV1> = serde_yaml::from_value(value)?;
            let first = w
                .spec
                .target_ports
                .first()
                .ok_or_else(|| invalid(K, &w.metadata.name, "spec.targetPorts is empty"))?;
            let target_port = port(K, &w.metadata.name, first.number)?;
            Ok(InferencePool {
                name: w.metadata.name,
                namespace: w.metadata.namespace,
                selector: w.spec.selector.match_labels,
                target_port,
            })
        }
        _ => Err(ObjectError::ApiVersion {
            kind: K,
            api_version: api,
            expected: "inference.networking.x-k8s.io/v1alpha2 or inference.networking.k8s.io/v1",
        }),
    }
}

fn model(value: serde_yaml::Value) -> Result<InferenceModel, ObjectError> {
    const K: &str = "InferenceModel";
    let w: Wire<ModelSpecWire> = serde_yaml::from_value(value)?;
    let name = &w.metadata.name;
    if w.spec.model_name.is_empty() {
        return Err(invalid(K, name, "spec.modelName is empty"));
    }
    let criticality = match w.spec.criticality.as_deref() {
        None => kvepp_core::Criticality::Standard,
        Some(c) => kvepp_core::Criticality::parse(c).ok_or_else(|| {
            invalid(
                K,
                name,
                format!("spec.criticality {c:?} is not Critical, Standard or Sheddable"),
            )
        })?,
    };
    let weighted = w
        .spec
        .target_models
        .iter()
        .filter(|t| t.weight.is_some())
        .count();
    if weighted != 0 && weighted != w.spec.target_models.len() {
        return Err(invalid(
            K,
            name,
            "spec.targetModels: set weight on all entries or on none",
        ));
    }
    let mut target_models = Vec::with_capacity(w.spec.target_models.len());
    for t in w.spec.target_models {
        let weight = t.weight.unwrap_or(1);
        let weight = u64::try_from(weight)
            .ok()
            .filter(|w| *w <= 1_000_000)
            .ok_or_else(|| {
                invalid(
                    K,
                    name,
                    format!(
                        "targetModels[{}].weight {weight} is not in 0..=1000000",
                        t.name
                    ),
                )
            })?;
        if t.name.is_empty() {
            return Err(invalid(K, name, "targetModels entry with an empty name"));
        }
        target_models.push((t.name, weight));
    }
    Ok(InferenceModel {
        name: w.metadata.name,
        namespace: w.metadata.namespace,
        model_name: w.spec.model_name,
        criticality,
        pool_ref: w.spec.pool_ref.name,
        target_models,
    })
}

/// Parses a multi-document YAML (or JSON) file. Any bad document fails the whole file, so a file
/// is applied all or nothing. `kind: List` documents are flattened.
pub fn parse_documents(text: &[u8]) -> Result<Vec<Object>, ObjectError> {
    let mut out = Vec::new();
    for doc in serde_yaml::Deserializer::from_slice(text) {
        let value = <serde_yaml::Value as serde::Deserialize>::deserialize(doc)?;
        collect(value, &mut out)?;
    }
    Ok(out)
}

fn collect(value: serde_yaml::Value, out: &mut Vec<Object>) -> Result<(), ObjectError> {
    if value.is_null() {
        return Ok(());
    }
    if value.get("kind").and_then(|k| k.as_str()) == Some("List") {
        if let Some(serde_yaml::Value::Sequence(items)) = value.get("items") {
            for item in items.clone() {
                collect(item, out)?;
            }
        }
        return Ok(());
    }
    if let Some(obj) = from_value(value)? {
        out.push(obj);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvepp_core::Criticality;

    #[test]
    fn both_pool_versions() {
        let objs = parse_documents(
            br#"
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {name: a}
spec: {targetPortNumber: 8000, selector: {app: vllm}}
---
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: b, namespace: ns}
spec:
  selector: {matchLabels: {app: sglang}}
  targetPorts: [{number: 30000}]
---
apiVersion: v1
kind: Service
metadata: {name: ignored}
"#,
        )
        .unwrap();
        assert_eq!(objs.len(), 2);
        let Object::Pool(a) = &objs[0] else { panic!() };
        assert_eq!(
            (a.name.as_str(), a.target_port, a.selector["app"].as_str()),
            ("a", 8000, "vllm")
        );
        let Object::Pool(b) = &objs[1] else { panic!() };
        assert_eq!(
            (
                b.namespace.as_deref(),
                b.target_port,
                b.selector["app"].as_str()
            ),
            (Some("ns"), 30000, "sglang")
        );
    }

    #[test]
    fn model_fields_and_defaults() {
        let objs = parse_documents(
            br#"
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {name: m}
spec:
  modelName: food-review
  criticality: Sheddable
  poolRef: {name: pool}
  targetModels: [{name: food-review-1, weight: 90}, {name: food-review-2, weight: 10}]
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {name: plain}
spec: {modelName: base, poolRef: {name: pool}, targetModels: [{name: x}, {name: y}]}
"#,
        )
        .unwrap();
        let Object::Model(m) = &objs[0] else { panic!() };
        assert_eq!(m.criticality, Criticality::Sheddable);
        assert_eq!(
            m.target_models,
            vec![("food-review-1".into(), 90), ("food-review-2".into(), 10)]
        );
        let Object::Model(p) = &objs[1] else { panic!() };
        assert_eq!(p.criticality, Criticality::Standard);
        assert_eq!(p.target_models, vec![("x".into(), 1), ("y".into(), 1)]);
    }

    #[test]
    fn invalid_objects_fail_the_file() {
        let bad = [
            &b"apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferencePool\nmetadata: {name: a}\nspec: {targetPortNumber: 70000}\n"[..],
            b"apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferenceModel\nmetadata: {name: m}\nspec: {modelName: x, poolRef: {name: p}, criticality: Urgent}\n",
            b"apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferenceModel\nmetadata: {name: m}\nspec: {modelName: x, poolRef: {name: p}, targetModels: [{name: a, weight: 1}, {name: b}]}\n",
            b"apiVersion: inference.networking.x-k8s.io/v9\nkind: InferencePool\nmetadata: {name: a}\nspec: {}\n",
            b"apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: s}\nendpoints: {oops: 1}\n",
            b"kind: [unclosed",
        ];
        for b in bad {
            assert!(
                parse_documents(b).is_err(),
                "{}",
                String::from_utf8_lossy(b)
            );
        }
    }

    #[test]
    fn slice_conditions() {
        let objs = parse_documents(
            br#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: s, labels: {kubernetes.io/service-name: pool}}
addressType: IPv4
endpoints:
- addresses: [10.0.0.1]
  conditions: {ready: true}
  targetRef: {kind: Pod, name: pod-a}
  zone: z1
  nodeName: n1
- addresses: [10.0.0.2]
- addresses: [10.0.0.3]
  conditions: {ready: false, serving: true, terminating: true}
ports: [{name: http, port: 8000, protocol: TCP}]
"#,
        )
        .unwrap();
        let Object::Slice(s) = &objs[0] else { panic!() };
        let ready: Vec<bool> = s
            .endpoints
            .iter()
            .map(|e| e.conditions.is_ready())
            .collect();
        assert_eq!(ready, vec![true, true, false]);
        assert_eq!(s.endpoints[0].zone.as_deref(), Some("z1"));
        assert_eq!(s.metadata.labels[SERVICE_NAME_LABEL], "pool");
    }
}
