//! The Kubernetes objects kvepp reads, reduced to the fields it uses, and their conversion into the
//! datastore's model. Both the manifests directory and the Kubernetes watcher produce these.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::engine::HttpVersion;

pub(crate) const GROUP_V1ALPHA2: &str = "inference.networking.x-k8s.io/v1alpha2";
pub(crate) const GROUP_V1: &str = "inference.networking.k8s.io/v1";
/// InferenceObjective as llm-d serves it now.
pub(crate) const LLMD_V1ALPHA2: &str = "llm-d.ai/v1alpha2";
pub(crate) const DISCOVERY_V1: &str = "discovery.k8s.io/v1";
pub(crate) const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

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
    /// RFC 3339, as the API server sets it (absent in manifests): the older of two conflicting
    /// objects is the one kept.
    #[serde(default, rename = "creationTimestamp")]
    pub creation_timestamp: Option<String>,
}

/// An InferencePool of either API version, normalised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InferencePool {
    pub name: String,
    pub namespace: Option<String>,
    pub selector: BTreeMap<String, String>,
    /// Every target port (`v1` `spec.targetPorts`, in order, never empty; `v1alpha2`: the one).
    /// With more than one, each is a data-parallel rank of the pod (its index) and every
    /// (pod, port) an endpoint.
    pub target_ports: Vec<u16>,
    /// The Service of the picker the pool names (`v1` `spec.endpointPickerRef.name`, `v1alpha2`
    /// `spec.extensionRef.name`).
    pub picker: Option<String>,
    /// What the proxy does when the picker fails: `FailOpen` or `FailClose` (the default).
    pub failure_mode: FailureMode,
    /// How the engines speak HTTP on the target ports (`v1` `spec.appProtocol`: `http`, or
    /// `kubernetes.io/h2c` for HTTP/2 with prior knowledge).
    pub app_protocol: HttpVersion,
}

impl InferencePool {
    /// The first target port: where a pod's one endpoint is served when its slice names no port.
    pub(crate) fn target_port(&self) -> Option<u16> {
        self.target_ports.first().copied()
    }
}

/// `failureMode` of the pool's picker reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailureMode {
    FailOpen,
    #[default]
    FailClose,
}

/// An InferenceObjective (`llm-d.ai/v1alpha2`, or the Inference Extension's
/// `inference.networking.x-k8s.io/v1alpha2`), normalised: chosen per request by header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InferenceObjective {
    pub name: String,
    pub namespace: Option<String>,
    /// Higher is more important; negative is sheddable; unset is 0.
    pub priority: i32,
    pub pool_ref: String,
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

/// An InferenceModelRewrite (`llm-d.ai/v1alpha2` or `inference.networking.x-k8s.io/v1alpha2`),
/// normalised: how a requested model name becomes the model the engines serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InferenceModelRewrite {
    pub name: String,
    pub namespace: Option<String>,
    pub pool_ref: String,
    /// `metadata.creationTimestamp` (RFC 3339; None in manifests): of two objects claiming one
    /// model the older is kept, then the first by name.
    pub created: Option<String>,
    /// In order: the first rule that matches a model is the one applied.
    pub rules: Vec<RewriteRule>,
}

/// One rule of an InferenceModelRewrite.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RewriteRule {
    /// Model names matched exactly; empty: every model no earlier rule took (the catch-all).
    pub models: Vec<String>,
    /// (model to send, weight); weights default to 1 when none is given, and sum to more than 0.
    pub targets: Vec<(String, u64)>,
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
    pub(crate) fn is_ready(&self) -> bool {
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
    Objective(InferenceObjective),
    Rewrite(InferenceModelRewrite),
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
    #[serde(default)]
    extension_ref: Option<PickerRef>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PoolSpecV1 {
    #[serde(default)]
    selector: LabelSelector,
    #[serde(default)]
    target_ports: Vec<PortNumber>,
    #[serde(default)]
    endpoint_picker_ref: Option<PickerRef>,
    #[serde(default)]
    app_protocol: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PickerRef {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    failure_mode: Option<String>,
}

#[derive(Deserialize)]
struct ObjectiveSpecWire {
    #[serde(default)]
    priority: Option<i64>,
    #[serde(rename = "poolRef")]
    pool_ref: NameRef,
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
#[serde(rename_all = "camelCase")]
struct RewriteSpecWire {
    pool_ref: NameRef,
    #[serde(default)]
    rules: Vec<RewriteRuleWire>,
}

#[derive(Deserialize)]
struct RewriteRuleWire {
    #[serde(default)]
    matches: Vec<RewriteMatchWire>,
    #[serde(default)]
    targets: Vec<RewriteTargetWire>,
}

#[derive(Deserialize)]
struct RewriteMatchWire {
    model: ModelMatchWire,
}

#[derive(Deserialize)]
struct ModelMatchWire {
    #[serde(default, rename = "type")]
    kind: Option<String>,
    value: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RewriteTargetWire {
    model_rewrite: String,
    #[serde(default)]
    weight: Option<i64>,
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
pub(crate) fn from_value(value: serde_yaml::Value) -> Result<Option<Object>, ObjectError> {
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
        "InferenceObjective" => {
            if api != LLMD_V1ALPHA2 && api != GROUP_V1ALPHA2 {
                return Err(ObjectError::ApiVersion {
                    kind: "InferenceObjective",
                    api_version: api,
                    expected: "llm-d.ai/v1alpha2 or inference.networking.x-k8s.io/v1alpha2",
                });
            }
            objective(value).map(|o| Some(Object::Objective(o)))
        }
        "InferenceModelRewrite" => {
            if api != LLMD_V1ALPHA2 && api != GROUP_V1ALPHA2 {
                return Err(ObjectError::ApiVersion {
                    kind: "InferenceModelRewrite",
                    api_version: api,
                    expected: "llm-d.ai/v1alpha2 or inference.networking.x-k8s.io/v1alpha2",
                });
            }
            rewrite(value).map(|r| Some(Object::Rewrite(r)))
        }
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
            let (picker, failure_mode) = picker_ref(&w.metadata.name, w.spec.extension_ref)?;
            Ok(InferencePool {
                name: w.metadata.name,
                namespace: w.metadata.namespace,
                selector: w.spec.selector,
                target_ports: vec![target_port],
                picker,
                failure_mode,
                app_protocol: HttpVersion::Http1,
            })
        }
        GROUP_V1 => {
            let w: Wire<PoolSpecV1> = serde_yaml::from_value(value)?;
            if w.spec.target_ports.is_empty() {
                return Err(invalid(K, &w.metadata.name, "spec.targetPorts is empty"));
            }
            let mut target_ports = Vec::with_capacity(w.spec.target_ports.len());
            for p in &w.spec.target_ports {
                let n = port(K, &w.metadata.name, p.number)?;
                if target_ports.contains(&n) {
                    return Err(invalid(
                        K,
                        &w.metadata.name,
                        format!("spec.targetPorts lists {n} twice"),
                    ));
                }
                target_ports.push(n);
            }
            let (picker, failure_mode) = picker_ref(&w.metadata.name, w.spec.endpoint_picker_ref)?;
            let app_protocol = match w.spec.app_protocol.as_deref() {
                None | Some("http") => HttpVersion::Http1,
                Some("kubernetes.io/h2c") => HttpVersion::H2c,
                Some(other) => {
                    return Err(invalid(
                        K,
                        &w.metadata.name,
                        format!("spec.appProtocol {other:?} is not http or kubernetes.io/h2c"),
                    ))
                }
            };
            Ok(InferencePool {
                name: w.metadata.name,
                namespace: w.metadata.namespace,
                selector: w.spec.selector.match_labels,
                target_ports,
                picker,
                failure_mode,
                app_protocol,
            })
        }
        _ => Err(ObjectError::ApiVersion {
            kind: K,
            api_version: api,
            expected: "inference.networking.x-k8s.io/v1alpha2 or inference.networking.k8s.io/v1",
        }),
    }
}

/// The picker's Service name and failure mode from a pool's picker reference.
fn picker_ref(
    pool: &str,
    r: Option<PickerRef>,
) -> Result<(Option<String>, FailureMode), ObjectError> {
    const K: &str = "InferencePool";
    let Some(r) = r else {
        return Ok((None, FailureMode::FailClose));
    };
    if let Some(kind) = r.kind.as_deref().filter(|k| *k != "Service") {
        return Err(invalid(
            K,
            pool,
            format!("the endpoint picker reference has kind {kind:?}; only Service is supported"),
        ));
    }
    let mode = match r.failure_mode.as_deref() {
        None | Some("FailClose") => FailureMode::FailClose,
        Some("FailOpen") => FailureMode::FailOpen,
        Some(other) => {
            return Err(invalid(
                K,
                pool,
                format!("failureMode {other:?} is not FailOpen or FailClose"),
            ))
        }
    };
    Ok((r.name.filter(|n| !n.is_empty()), mode))
}

fn objective(value: serde_yaml::Value) -> Result<InferenceObjective, ObjectError> {
    const K: &str = "InferenceObjective";
    let w: Wire<ObjectiveSpecWire> = serde_yaml::from_value(value)?;
    let priority = match w.spec.priority {
        None => 0,
        Some(p) => i32::try_from(p).map_err(|_| {
            invalid(
                K,
                &w.metadata.name,
                format!("spec.priority {p} is out of range"),
            )
        })?,
    };
    if w.metadata.name.is_empty() {
        return Err(invalid(K, "", "metadata.name is empty"));
    }
    Ok(InferenceObjective {
        name: w.metadata.name,
        namespace: w.metadata.namespace,
        priority,
        pool_ref: w.spec.pool_ref.name,
    })
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
    let targets = w.spec.target_models.into_iter().map(|t| (t.name, t.weight));
    let target_models = weighted_targets(K, name, "spec.targetModels", targets)?;
    Ok(InferenceModel {
        name: w.metadata.name,
        namespace: w.metadata.namespace,
        model_name: w.spec.model_name,
        criticality,
        pool_ref: w.spec.pool_ref.name,
        target_models,
    })
}

/// Weighted target models: weights on all entries or on none (then 1 each), each in
/// 0..=1000000, names not empty.
fn weighted_targets(
    kind: &'static str,
    name: &str,
    field: &str,
    targets: impl ExactSizeIterator<Item = (String, Option<i64>)>,
) -> Result<Vec<(String, u64)>, ObjectError> {
    let targets: Vec<_> = targets.collect();
    let weighted = targets.iter().filter(|(_, w)| w.is_some()).count();
    if weighted != 0 && weighted != targets.len() {
        return Err(invalid(
            kind,
            name,
            format!("{field}: set weight on all entries or on none"),
        ));
    }
    let mut out = Vec::with_capacity(targets.len());
    for (target, weight) in targets {
        let weight = weight.unwrap_or(1);
        let weight = u64::try_from(weight)
            .ok()
            .filter(|w| *w <= 1_000_000)
            .ok_or_else(|| {
                invalid(
                    kind,
                    name,
                    format!("{field}[{target}].weight {weight} is not in 0..=1000000"),
                )
            })?;
        if target.is_empty() {
            return Err(invalid(
                kind,
                name,
                format!("{field}: an entry with an empty name"),
            ));
        }
        out.push((target, weight));
    }
    Ok(out)
}

fn rewrite(value: serde_yaml::Value) -> Result<InferenceModelRewrite, ObjectError> {
    const K: &str = "InferenceModelRewrite";
    let w: Wire<RewriteSpecWire> = serde_yaml::from_value(value)?;
    let name = &w.metadata.name;
    if name.is_empty() {
        return Err(invalid(K, "", "metadata.name is empty"));
    }
    if w.spec.rules.is_empty() {
        return Err(invalid(K, name, "spec.rules is empty"));
    }
    let mut rules = Vec::with_capacity(w.spec.rules.len());
    for (i, rule) in w.spec.rules.into_iter().enumerate() {
        let mut models = Vec::with_capacity(rule.matches.len());
        for m in rule.matches {
            match m.model.kind.as_deref() {
                None | Some("Exact") => {}
                Some(other) => {
                    return Err(invalid(
                        K,
                        name,
                        format!("spec.rules[{i}]: match type {other:?} is not Exact"),
                    ))
                }
            }
            if m.model.value.is_empty() {
                return Err(invalid(
                    K,
                    name,
                    format!("spec.rules[{i}]: an empty model value"),
                ));
            }
            models.push(m.model.value);
        }
        if rule.targets.is_empty() {
            return Err(invalid(
                K,
                name,
                format!("spec.rules[{i}].targets is empty"),
            ));
        }
        let field = format!("spec.rules[{i}].targets");
        let targets = rule
            .targets
            .into_iter()
            .map(|t| (t.model_rewrite, t.weight));
        let targets = weighted_targets(K, name, &field, targets)?;
        if targets.iter().all(|(_, w)| *w == 0) {
            return Err(invalid(K, name, format!("{field}: the weights sum to 0")));
        }
        rules.push(RewriteRule { models, targets });
    }
    Ok(InferenceModelRewrite {
        name: w.metadata.name,
        namespace: w.metadata.namespace,
        pool_ref: w.spec.pool_ref.name,
        created: w.metadata.creation_timestamp,
        rules,
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
            (a.name.as_str(), a.target_port(), a.selector["app"].as_str()),
            ("a", Some(8000), "vllm")
        );
        let Object::Pool(b) = &objs[1] else { panic!() };
        assert_eq!(
            (
                b.namespace.as_deref(),
                b.target_port(),
                b.selector["app"].as_str()
            ),
            (Some("ns"), Some(30000), "sglang")
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
    fn objectives_and_v1_pool_fields() {
        let objs = parse_documents(
            br#"
apiVersion: llm-d.ai/v1alpha2
kind: InferenceObjective
metadata: {name: interactive}
spec: {priority: 10, poolRef: {name: pool}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: batch}
spec: {poolRef: {group: inference.networking.k8s.io, name: pool}}
---
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: pool}
spec:
  selector: {matchLabels: {app: vllm}}
  targetPorts: [{number: 8000}]
  appProtocol: kubernetes.io/h2c
  endpointPickerRef: {name: kvepp, port: {number: 9002}, failureMode: FailOpen}
"#,
        )
        .unwrap();
        let Object::Objective(i) = &objs[0] else {
            panic!()
        };
        assert_eq!(
            (i.name.as_str(), i.priority, i.pool_ref.as_str()),
            ("interactive", 10, "pool")
        );
        let Object::Objective(b) = &objs[1] else {
            panic!()
        };
        assert_eq!(b.priority, 0, "unset priority is 0");
        let Object::Pool(p) = &objs[2] else { panic!() };
        assert_eq!(p.picker.as_deref(), Some("kvepp"));
        assert_eq!(p.failure_mode, FailureMode::FailOpen);
        assert_eq!(p.app_protocol, HttpVersion::H2c);
        for bad in [
            "appProtocol: grpc",
            "endpointPickerRef: {name: x, failureMode: Sometimes}",
            "endpointPickerRef: {name: x, kind: Deployment}",
        ] {
            let doc = format!("apiVersion: inference.networking.k8s.io/v1\nkind: InferencePool\nmetadata: {{name: p}}\nspec:\n  targetPorts: [{{number: 1}}]\n  {bad}\n");
            let e = parse_documents(doc.as_bytes()).unwrap_err().to_string();
            assert!(e.contains("InferencePool \"p\""), "{e}");
        }
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
            b"apiVersion: llm-d.ai/v1alpha2\nkind: InferenceObjective\nmetadata: {name: o}\nspec: {priority: 99999999999, poolRef: {name: p}}\n",
            b"apiVersion: llm-d.ai/v1alpha2\nkind: InferenceObjective\nmetadata: {name: o}\nspec: {priority: 1}\n",
            b"apiVersion: llm-d.ai/v9\nkind: InferenceObjective\nmetadata: {name: o}\nspec: {poolRef: {name: p}}\n",
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
