//! The routing policies `bench-routing` compares: how each configures kvepp (picker, cost model,
//! KV events), and the two clairvoyant references that start none.

use kvepp::config::PickerKind;
use kvepp_core::cost::CostModel;

/// A routing policy, as kvepp's configuration selects it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Policy {
    RoundRobin,
    LeastLoaded,
    /// KV-aware cost over what kvepp routed (no KV events).
    ApproximatePrefix,
    /// KV-aware cost over the engines' KV events.
    #[value(name = "precise-kv", alias = "precise")]
    Precise,
    /// The engines' KV events, candidates ranked by predicted TTFT learned online.
    PreciseTtft,
    /// What a user gets: the KV-aware picker over the engines' KV events with the configuration
    /// as given (the shipped defaults unless `--kvepp-config` changes them).
    Default,
    /// Not a router: the reference placement that reads every engine's true cache and queue
    /// ([`super::oracle`]), sending each request straight to the engine with the lowest TTFT.
    Clairvoyant,
    /// Not a router: the same clairvoyant view, sending each request to the engine where its own
    /// completion (TTFT and its decode there, knowing its output length) is soonest.
    ClairvoyantCompletion,
}

impl Policy {
    pub const ALL: [Policy; 7] = [
        Policy::RoundRobin,
        Policy::LeastLoaded,
        Policy::ApproximatePrefix,
        Policy::Precise,
        Policy::Default,
        Policy::Clairvoyant,
        Policy::ClairvoyantCompletion,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::LeastLoaded => "least-loaded",
            Policy::ApproximatePrefix => "approximate-prefix",
            Policy::Precise => "precise-kv",
            Policy::PreciseTtft => "precise-ttft",
            Policy::Default => "default",
            Policy::Clairvoyant => "clairvoyant",
            Policy::ClairvoyantCompletion => "clairvoyant-completion",
        }
    }

    /// The reference placement this policy is, if it is one (no kvepp, no Envoy).
    pub fn reference(self) -> Option<super::oracle::Objective> {
        match self {
            Policy::Clairvoyant => Some(super::oracle::Objective::FirstToken),
            Policy::ClairvoyantCompletion => Some(super::oracle::Objective::Completion),
            _ => None,
        }
    }

    /// Whether the policy's picker books load in the slot tracker (what replica sync shares).
    pub fn picker_is_kv_aware(self) -> bool {
        matches!(
            self,
            Policy::ApproximatePrefix | Policy::Precise | Policy::PreciseTtft | Policy::Default
        )
    }

    pub fn picker(self) -> PickerKind {
        match self {
            // The clairvoyant placements start no kvepp.
            Policy::RoundRobin | Policy::Clairvoyant | Policy::ClairvoyantCompletion => {
                PickerKind::RoundRobin
            }
            Policy::LeastLoaded => PickerKind::LeastLoaded,
            Policy::ApproximatePrefix => PickerKind::ApproximatePrefix,
            Policy::Precise | Policy::PreciseTtft | Policy::Default => PickerKind::KvAware,
        }
    }

    /// What the KV-aware picker minimises under this policy (None: what the configuration says).
    pub fn cost_model(self) -> Option<CostModel> {
        match self {
            Policy::PreciseTtft => Some(CostModel::PredictedTtft),
            Policy::Default => None,
            _ => Some(CostModel::Dynamo),
        }
    }

    /// Whether kvepp subscribes to the engines' KV events under this policy.
    pub fn uses_kv_events(self) -> bool {
        matches!(
            self,
            Policy::Precise | Policy::PreciseTtft | Policy::Default
        )
    }
}
