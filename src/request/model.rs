//! Mapping a requested model name to its InferenceModel: criticality and the weighted choice of a
//! target model.

use std::sync::Arc;

use crate::discovery::{ModelSpec, PoolSnapshot};
use kvepp_core::Criticality;

/// Label used in metrics for model names that match no InferenceModel (bounded cardinality).
pub const UNLISTED_MODEL_LABEL: &str = "unlisted";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ModelError {
    #[error("model {0:?} is not served by this pool (no InferenceModel has this modelName)")]
    Unknown(String),
}

/// What to do with a request's model.
#[derive(Debug, Clone)]
pub struct ModelDecision {
    /// The InferenceModel's name, or [`UNLISTED_MODEL_LABEL`] on pass-through.
    pub model_label: Arc<str>,
    /// The chosen target model; `None` when the body keeps its model.
    pub rewrite_to: Option<Arc<str>>,
    /// Label for the target model: the rewrite target, else the model label.
    pub target_label: Arc<str>,
    pub criticality: Criticality,
}

/// Resolves `name` against the pool's InferenceModels. With `unlisted` (pass-through), a model with
/// no InferenceModel is routed as Standard without rewrite (as newer reference EPPs do), under that
/// metric label; without it, such a model is an error (404).
pub fn resolve_model(
    snapshot: &PoolSnapshot,
    name: &str,
    unlisted: Option<&Arc<str>>,
) -> Result<ModelDecision, ModelError> {
    match snapshot.models.get(name) {
        Some(spec) => {
            let target = pick_target(spec, fastrand::u64(..));
            let rewrite_to = target.filter(|t| &***t != name).cloned();
            Ok(ModelDecision {
                model_label: spec.name.clone(),
                target_label: rewrite_to.clone().unwrap_or_else(|| spec.name.clone()),
                rewrite_to,
                criticality: spec.criticality,
            })
        }
        None => match unlisted {
            Some(label) => Ok(ModelDecision {
                model_label: label.clone(),
                rewrite_to: None,
                target_label: label.clone(),
                criticality: Criticality::Standard,
            }),
            None => Err(ModelError::Unknown(name.to_owned())),
        },
    }
}

/// Weighted choice among the target models, driven by `roll` (uniform over u64). `None` when the
/// model has no targets (or only zero weights): the request keeps its model name.
pub(crate) fn pick_target(spec: &ModelSpec, roll: u64) -> Option<&Arc<str>> {
    if spec.total_weight == 0 {
        return None;
    }
    let mut point = roll % spec.total_weight;
    for (name, weight) in &spec.targets {
        if point < *weight {
            return Some(name);
        }
        point -= *weight;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(targets: &[(&str, u64)]) -> ModelSpec {
        ModelSpec::new(
            "base",
            Criticality::Standard,
            targets.iter().map(|(n, w)| (Arc::from(*n), *w)).collect(),
        )
    }

    #[test]
    fn weights_split_by_ratio() {
        let s = spec(&[("a", 1), ("b", 3), ("zero", 0)]);
        let mut counts = [0u32; 2];
        for roll in 0..4000u64 {
            match pick_target(&s, roll).map(|t| &**t) {
                Some("a") => counts[0] += 1,
                Some("b") => counts[1] += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(counts, [1000, 3000]);
    }

    #[test]
    fn no_targets_means_no_rewrite() {
        assert!(pick_target(&spec(&[]), 5).is_none());
        assert!(pick_target(&spec(&[("a", 0)]), 5).is_none());
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
        let d = resolve_model(&snap, "base", None).unwrap();
        assert!(
            d.rewrite_to.is_none(),
            "a target equal to the model is no rewrite"
        );
        let d = resolve_model(&snap, "lora", None).unwrap();
        assert_eq!(d.rewrite_to.as_deref(), Some("lora-v2"));
        assert_eq!(&*d.target_label, "lora-v2");
        assert_eq!(d.criticality, Criticality::Sheddable);
        assert_eq!(
            resolve_model(&snap, "nope", None).unwrap_err(),
            ModelError::Unknown("nope".into())
        );
        let d = resolve_model(&snap, "nope", Some(&Arc::from(UNLISTED_MODEL_LABEL))).unwrap();
        assert_eq!(&*d.model_label, UNLISTED_MODEL_LABEL);
        assert_eq!(d.criticality, Criticality::Standard);
    }
}
