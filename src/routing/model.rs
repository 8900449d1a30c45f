//! Mapping a requested model name to the model the engines serve: the pool's
//! InferenceModelRewrites first, then its InferenceModels (criticality, weighted target models).
//!
//! Precedence: a rewrite rule that matches the requested name (exactly, else the catch-all)
//! decides the served model; the InferenceModel of the *served* name, if any, then gives the
//! request its criticality (no second rewrite). Without a rewrite, the requested name's
//! InferenceModel does both, as before rewrites existed.
//!
//! Weighted draws: with a session key (the session header, else the fairness id) the draw is a
//! weighted rendezvous hash of the key and each target's name, so a conversation keeps its target
//! while the weights stand, every replica draws the same, and moving weight between targets moves
//! only the keys whose target must change (the share moved); without a key, a uniform draw.

use std::sync::Arc;

use crate::discovery::{PoolSnapshot, Targets};
use kvepp_core::Criticality;

/// Label used in metrics for model names that match no InferenceModel or rewrite by name
/// (bounded cardinality).
pub const UNLISTED_MODEL_LABEL: &str = "unlisted";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ModelError {
    #[error("model {0:?} is not served by this pool (no InferenceModel or InferenceModelRewrite names it)")]
    Unknown(String),
}

/// What to do with a request's model.
#[derive(Debug, Clone)]
pub struct ModelDecision {
    /// The requested model (when an InferenceModel or a rewrite names it), or
    /// [`UNLISTED_MODEL_LABEL`].
    pub model_label: Arc<str>,
    /// The chosen target model; `None` when the body keeps its model.
    pub rewrite_to: Option<Arc<str>>,
    /// Label for the target model: the rewrite target, else the model label.
    pub target_label: Arc<str>,
    pub criticality: Criticality,
    /// The InferenceModelRewrite that decided the target, when one did.
    pub rewrite: Option<Arc<str>>,
}

/// Resolves `name` against the pool's rewrites and InferenceModels, drawing weighted targets by
/// `key` when given (see the module doc). With `unlisted` (pass-through), a model nothing names
/// is routed as Standard without rewrite (as newer reference EPPs do), under that metric label;
/// without it, such a model is an error (404).
pub fn resolve_model(
    snapshot: &PoolSnapshot,
    name: &str,
    unlisted: Option<&Arc<str>>,
    key: Option<u64>,
) -> Result<ModelDecision, ModelError> {
    if let Some((rule, by_name)) = snapshot.rewrites.rule(name) {
        if let Some(target) = draw(&rule.targets, key) {
            let listed = snapshot.models.get(name);
            let model_label: Option<Arc<str>> = match (by_name, listed) {
                (_, Some(spec)) => Some(spec.name.clone()),
                (true, None) => Some(name.into()),
                (false, None) => unlisted.cloned(),
            };
            let model_label = model_label.unwrap_or_else(|| UNLISTED_MODEL_LABEL.into());
            let criticality = snapshot
                .models
                .get(&**target)
                .map_or(Criticality::Standard, |m| m.criticality);
            return Ok(ModelDecision {
                model_label,
                rewrite_to: (&**target != name).then(|| target.clone()),
                target_label: target.clone(),
                criticality,
                rewrite: Some(rule.object.clone()),
            });
        }
    }
    match snapshot.models.get(name) {
        Some(spec) => {
            let target = draw(&spec.targets, key);
            let rewrite_to = target.filter(|t| &***t != name).cloned();
            Ok(ModelDecision {
                model_label: spec.name.clone(),
                target_label: rewrite_to.clone().unwrap_or_else(|| spec.name.clone()),
                rewrite_to,
                criticality: spec.criticality,
                rewrite: None,
            })
        }
        None => match unlisted {
            Some(label) => Ok(ModelDecision {
                model_label: label.clone(),
                rewrite_to: None,
                target_label: label.clone(),
                criticality: Criticality::Standard,
                rewrite: None,
            }),
            None => Err(ModelError::Unknown(name.to_owned())),
        },
    }
}

/// A weighted draw among `targets`: keyed (rendezvous) with a key, uniform without. `None` when
/// there is no target with a weight above 0: the request keeps its model name.
pub(crate) fn draw(targets: &Targets, key: Option<u64>) -> Option<&Arc<str>> {
    match key {
        Some(k) => keyed_target(targets, k),
        None => pick_target(targets, fastrand::u64(..)),
    }
}

/// Weighted choice driven by `roll` (uniform over u64).
pub(crate) fn pick_target(targets: &Targets, roll: u64) -> Option<&Arc<str>> {
    if targets.total == 0 {
        return None;
    }
    let mut point = roll % targets.total;
    for (name, weight) in &targets.list {
        if point < *weight {
            return Some(name);
        }
        point -= *weight;
    }
    None
}

/// Weighted rendezvous hashing: each target draws `u` in (0, 1) from a hash of (key, its name)
/// and scores `-ln(u) / weight` (an exponential race, won with probability weight / total); the
/// lowest score wins. A target's score depends only on the key, its name and its weight, so a
/// weight change moves only keys to or from that target.
fn keyed_target(targets: &Targets, key: u64) -> Option<&Arc<str>> {
    let mut best: Option<(f64, &Arc<str>)> = None;
    for (name, weight) in targets.list.iter().filter(|(_, w)| *w > 0) {
        let h = xxhash_rust::xxh3::xxh3_64_with_seed(name.as_bytes(), key);
        let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let score = -u.ln() / *weight as f64;
        if best.is_none_or(|(s, _)| score < s) {
            best = Some((score, name));
        }
    }
    best.map(|(_, n)| n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::objects::parse_documents;
    use crate::discovery::{Datastore, Inventory, ModelSpec, PoolRef};

    fn spec(targets: &[(&str, u64)]) -> ModelSpec {
        ModelSpec::new(
            "base",
            Criticality::Standard,
            targets.iter().map(|(n, w)| (Arc::from(*n), *w)).collect(),
        )
    }

    fn targets(list: &[(&str, u64)]) -> Targets {
        Targets::new(list.iter().map(|(n, w)| (Arc::from(*n), *w)).collect())
    }

    #[test]
    fn weights_split_by_ratio() {
        let s = spec(&[("a", 1), ("b", 3), ("zero", 0)]);
        let mut counts = [0u32; 2];
        for roll in 0..4000u64 {
            match pick_target(&s.targets, roll).map(|t| &**t) {
                Some("a") => counts[0] += 1,
                Some("b") => counts[1] += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(counts, [1000, 3000]);
    }

    #[test]
    fn no_targets_means_no_rewrite() {
        for t in [targets(&[]), targets(&[("a", 0)])] {
            assert!(pick_target(&t, 5).is_none());
            assert!(keyed_target(&t, 5).is_none());
        }
    }

    #[test]
    fn keyed_draws_follow_the_weights_and_keep_a_key_on_its_target() {
        let t = targets(&[("v1", 90), ("v2", 10), ("off", 0)]);
        let keys = 0..20_000u64;
        let v2 = keys
            .clone()
            .filter(|k| {
                keyed_target(&t, k.wrapping_mul(0x9e37_79b9_7f4a_7c15)).map(|n| &**n) == Some("v2")
            })
            .count();
        assert!(
            (1_600..=2_400).contains(&v2),
            "10% of 20000 keys expected on v2, got {v2}"
        );
        for k in keys.clone().take(100) {
            assert_eq!(
                keyed_target(&t, k),
                keyed_target(&t, k),
                "a key keeps its target"
            );
        }
        // Moving 10 points of weight to v2 moves about that share of the keys, all from v1 to v2.
        let moved_to = targets(&[("v1", 80), ("v2", 20)]);
        let mut moved = 0;
        for k in keys {
            let (before, after) = (keyed_target(&t, k), keyed_target(&moved_to, k));
            if before != after {
                assert_eq!(
                    (before.map(|n| &**n), after.map(|n| &**n)),
                    (Some("v1"), Some("v2")),
                    "only keys that must move, move, and only toward the target that gained"
                );
                moved += 1;
            }
        }
        assert!(
            (1_600..=2_400).contains(&moved),
            "about 10% of keys move, got {moved}"
        );
    }

    #[test]
    fn resolve_known_unknown_and_pass_through() {
        let mut snap = PoolSnapshot::empty();
        snap.models
            .insert("base".into(), Arc::new(spec(&[("base", 1)])));
        snap.models.insert(
            "lora".into(),
            Arc::new(ModelSpec::new(
                "lora",
                Criticality::Sheddable,
                vec![(Arc::from("lora-v2"), 5)],
            )),
        );
        let d = resolve_model(&snap, "base", None, None).unwrap();
        assert!(
            d.rewrite_to.is_none(),
            "a target equal to the model is no rewrite"
        );
        let d = resolve_model(&snap, "lora", None, Some(7)).unwrap();
        assert_eq!(d.rewrite_to.as_deref(), Some("lora-v2"));
        assert_eq!(&*d.target_label, "lora-v2");
        assert_eq!(d.criticality, Criticality::Sheddable);
        assert_eq!(
            resolve_model(&snap, "nope", None, None).unwrap_err(),
            ModelError::Unknown("nope".into())
        );
        let d = resolve_model(&snap, "nope", Some(&Arc::from(UNLISTED_MODEL_LABEL)), None).unwrap();
        assert_eq!(&*d.model_label, UNLISTED_MODEL_LABEL);
        assert_eq!(d.criticality, Criticality::Standard);
    }

    const REWRITES: &str = r#"
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: pool}
spec: {selector: {matchLabels: {app: v}}, targetPorts: [{number: 8000}]}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {name: critical-v1}
spec: {modelName: food-v1, criticality: Critical, poolRef: {name: pool}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {name: listed}
spec: {modelName: listed, criticality: Sheddable, poolRef: {name: pool}, targetModels: [{name: listed-v9}]}
---
apiVersion: llm-d.ai/v1alpha2
kind: InferenceModelRewrite
metadata: {name: a-food, creationTimestamp: "2026-01-01T00:00:00Z"}
spec:
  poolRef: {name: pool}
  rules:
  - matches: [{model: {type: Exact, value: food}}, {model: {value: listed}}]
    targets: [{modelRewrite: food-v1}]
  - matches: [{model: {value: food}}]
    targets: [{modelRewrite: never}]
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModelRewrite
metadata: {name: b-newer, creationTimestamp: "2026-02-01T00:00:00Z"}
spec:
  poolRef: {name: pool}
  rules:
  - matches: [{model: {value: food}}]
    targets: [{modelRewrite: stolen}]
  - matches: []
    targets: [{modelRewrite: base, weight: 1}]
  - matches: [{model: {value: shadowed}}]
    targets: [{modelRewrite: never}]
---
apiVersion: llm-d.ai/v1alpha2
kind: InferenceModelRewrite
metadata: {name: c-other-pool}
spec:
  poolRef: {name: elsewhere}
  rules: [{matches: [{model: {value: x}}], targets: [{modelRewrite: y}]}]
"#;

    fn rewrite_snapshot() -> Arc<PoolSnapshot> {
        let store = Datastore::new(
            PoolRef {
                name: "pool".into(),
                namespace: "default".into(),
                service: "pool".into(),
                picker_service: None,
            },
            |_| {},
        );
        store.apply(&Inventory {
            objects: parse_documents(REWRITES.as_bytes()).unwrap(),
        });
        store.snapshot()
    }

    #[test]
    fn a_rewrite_applies_first_and_the_served_names_inference_model_gives_criticality() {
        let snap = rewrite_snapshot();
        let d = resolve_model(&snap, "food", None, None).unwrap();
        assert_eq!(d.rewrite_to.as_deref(), Some("food-v1"));
        assert_eq!((&*d.model_label, &*d.target_label), ("food", "food-v1"));
        assert_eq!(
            d.criticality,
            Criticality::Critical,
            "food-v1's InferenceModel"
        );
        assert_eq!(
            d.rewrite.as_deref(),
            Some("a-food"),
            "the older object keeps food"
        );
        // A listed model a rewrite matches: the rewrite decides; its InferenceModel's own targets
        // are not drawn, and the served name has no InferenceModel: Standard.
        let d = resolve_model(&snap, "listed", None, None).unwrap();
        assert_eq!(d.rewrite_to.as_deref(), Some("food-v1"));
        assert_eq!(&*d.model_label, "listed");
    }

    #[test]
    fn the_catch_all_takes_every_other_model_and_conflicts_are_counted() {
        let snap = rewrite_snapshot();
        // No pass-through, yet a model nothing lists is served through the catch-all.
        let d = resolve_model(&snap, "anything", None, Some(3)).unwrap();
        assert_eq!(d.rewrite_to.as_deref(), Some("base"));
        assert_eq!(&*d.model_label, UNLISTED_MODEL_LABEL, "bounded label");
        assert_eq!(d.rewrite.as_deref(), Some("b-newer"));
        // `shadowed` follows b-newer's catch-all: never reached.
        let d = resolve_model(&snap, "shadowed", None, None).unwrap();
        assert_eq!(d.rewrite_to.as_deref(), Some("base"));
        // food claimed again by b-newer, and the rule after b-newer's catch-all.
        assert_eq!(snap.rewrites.conflicts, 2);
        assert!(
            !snap.rewrites.exact.contains_key("x"),
            "another pool's rewrite"
        );
        assert_eq!(
            snap.rewrites
                .exact
                .keys()
                .map(String::as_str)
                .collect::<std::collections::BTreeSet<_>>(),
            ["food", "listed"].into()
        );
    }
}
