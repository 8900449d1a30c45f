//! Prefill/decode disaggregation: which endpoints prefill, which decode, and which decode worker a
//! prefill worker hands its KV cache to, under the topology constraint of the design document
//! (`kv_transfer_topology_level`, `kv_transfer_mismatch_policy`) and its soft preference
//! (`kv_transfer_weight`).
//!
//! What it owns: the endpoint roles ([`Role`]), the settings ([`TransferSettings`]), and the two
//! pure steps of a disaggregated pick that the [`crate::Router`] runs around its ordinary picks:
//! [`TransferSettings::prefill_candidates`] (before the prefill pick: prefer prefill workers that
//! have a decode worker in their domain) and [`TransferSettings::decode_candidates`] (after it:
//! the decode workers the transfer may go to, and each one's transfer cost).
//!
//! Invariants, straight from the document's runtime table:
//! - level unset: no topology filtering; every decode worker is a candidate;
//! - level set, same-domain decode workers exist: only they are candidates (workers missing the
//!   level are excluded);
//! - none: `fail` → [`PickError::TopologyMismatch`]; `fallback` → every decode worker (those
//!   missing the level included), and the pairing is marked as crossing domains;
//! - the transfer cost is 0 when `kv_transfer_weight` is 0, else
//!   `weight × (latency_ms + kv_bytes / bytes_per_ms)` of the narrowest level the pair shares.

/// Request header naming the prefill worker of a disaggregated pick (`ip:port`), as the llm-d
/// routing sidecar on the decode worker reads it: the EPP sets it, a decode engine (or its
/// sidecar) reads it.
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::endpoint::Endpoint;
pub use crate::endpoint::{Domains, Role};
pub use crate::pick::Pairing;
use crate::pick::PickError;

/// `kv_transfer_mismatch_policy`: what happens when no decode worker shares the prefill worker's
/// domain.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum MismatchPolicy {
    /// The request is refused (the transfer constraint is hard).
    #[default]
    Fail,
    /// A warning, then any decode worker.
    Fallback,
}

impl MismatchPolicy {
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim() {
            "fail" => Some(Self::Fail),
            "fallback" => Some(Self::Fallback),
            _ => None,
        }
    }
}

/// The network between two workers that share a topology level (or none).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LinkQos {
    /// One-way latency of a transfer, in milliseconds.
    pub latency_ms: f64,
    /// Throughput of a transfer, in gigabytes (10⁹ bytes) per second.
    pub bandwidth_gb_per_s: f64,
}

impl LinkQos {
    /// Finite, non-negative latency and a finite, positive bandwidth.
    pub fn is_valid(&self) -> bool {
        self.latency_ms.is_finite()
            && self.latency_ms >= 0.0
            && self.bandwidth_gb_per_s.is_finite()
            && self.bandwidth_gb_per_s > 0.0
    }

    /// Milliseconds to move `bytes` over this link.
    pub fn transfer_ms(&self, bytes: f64) -> f64 {
        let per_ms = self.bandwidth_gb_per_s * 1e6;
        let data = if per_ms > 0.0 { bytes / per_ms } else { 0.0 };
        self.latency_ms + data
    }
}

/// One topology level of the QoS table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LevelQos {
    /// The level's name, as in the workers' `topology_domains` (`host`, `rack`, `zone`, ...).
    pub level: String,
    pub latency_ms: f64,
    pub bandwidth_gb_per_s: f64,
}

impl LevelQos {
    pub fn qos(&self) -> LinkQos {
        LinkQos {
            latency_ms: self.latency_ms,
            bandwidth_gb_per_s: self.bandwidth_gb_per_s,
        }
    }
}

/// Disaggregation and KV-transfer topology settings (config section `disaggregation`; the two
/// `DYN_ROUTER_KV_TRANSFER_*` variables override the file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TransferSettings {
    /// Prompts shorter than this many tokens skip the prefill hop (the decode worker prefills).
    pub prefill_threshold_tokens: u64,
    /// `DYN_ROUTER_KV_TRANSFER_TOPOLOGY_LEVEL`: the topology level KV transfers stay within
    /// (unset: no filtering, picks identical to an unconstrained pool).
    pub kv_transfer_topology_level: Option<String>,
    /// `DYN_ROUTER_KV_TRANSFER_MISMATCH_POLICY`: `fail` (default) or `fallback`.
    pub kv_transfer_mismatch_policy: MismatchPolicy,
    /// Soft preference: weight of the transfer cost added to each decode candidate's cost
    /// (0: off). The cost is in milliseconds; the decode cost is in KV blocks, so a weight of 1
    /// trades one millisecond of transfer for one block of decode load.
    pub kv_transfer_weight: f64,
    /// KV-cache bytes per prompt token (an 8B Llama in bf16: 32 layers × 8 KV heads × 128 × 2 × 2
    /// = 131072).
    pub kv_bytes_per_token: u64,
    /// The links, narrowest level first: a pair's transfer uses the first level whose value both
    /// workers share.
    pub transfer_qos: Vec<LevelQos>,
    /// The link between workers that share none of the levels.
    pub cross_domain_qos: LinkQos,
}

impl Default for TransferSettings {
    fn default() -> Self {
        let level = |level: &str, latency_ms, bandwidth_gb_per_s| LevelQos {
            level: level.into(),
            latency_ms,
            bandwidth_gb_per_s,
        };
        TransferSettings {
            prefill_threshold_tokens: 0,
            kv_transfer_topology_level: None,
            kv_transfer_mismatch_policy: MismatchPolicy::Fail,
            kv_transfer_weight: 0.0,
            kv_bytes_per_token: 131_072,
            transfer_qos: vec![
                level("host", 0.01, 200.0),
                level("rack", 0.05, 50.0),
                level("zone", 0.5, 12.5),
            ],
            cross_domain_qos: LinkQos {
                latency_ms: 2.0,
                bandwidth_gb_per_s: 3.0,
            },
        }
    }
}

/// The decode workers a prefill worker may hand over to, and what each transfer costs.
#[derive(Debug)]
pub struct DecodeCandidates {
    pub endpoints: Vec<Arc<Endpoint>>,
    /// Transfer cost per endpoint (empty when `kv_transfer_weight` is 0).
    pub bias: Vec<f64>,
    /// No decode worker shared the prefill worker's domain: the fallback policy let any go.
    pub crossed: bool,
}

impl TransferSettings {
    /// Every knob that must be finite and non-negative, with its name.
    pub fn validate(&self) -> Vec<(&'static str, String)> {
        let mut bad = Vec::new();
        if !(self.kv_transfer_weight.is_finite() && self.kv_transfer_weight >= 0.0) {
            bad.push((
                "kv_transfer_weight",
                format!("{} must be finite and ≥ 0", self.kv_transfer_weight),
            ));
        }
        let links = self
            .transfer_qos
            .iter()
            .map(LevelQos::qos)
            .chain([self.cross_domain_qos]);
        for q in links {
            if !q.is_valid() {
                bad.push((
                    "transfer_qos",
                    format!("{q:?}: latency must be ≥ 0 and bandwidth > 0"),
                ));
            }
        }
        if self.kv_transfer_topology_level.as_deref() == Some("") {
            bad.push((
                "kv_transfer_topology_level",
                "must not be empty (leave it unset for no topology filtering)".into(),
            ));
        }
        bad
    }

    fn level(&self) -> Option<&str> {
        self.kv_transfer_topology_level.as_deref()
    }

    /// Whether `eps` is a disaggregated pool (some endpoint only prefills or only decodes).
    pub fn is_disaggregated(eps: &[Arc<Endpoint>]) -> bool {
        eps.iter().any(|e| e.role != Role::Both)
    }

    /// Prefill candidates: with a topology level, those with a decode worker in their own domain
    /// first; when none has one, all of them (a decode worker may be about to join).
    pub fn prefill_candidates(
        &self,
        prefill: Vec<Arc<Endpoint>>,
        decode: &[Arc<Endpoint>],
    ) -> Vec<Arc<Endpoint>> {
        let Some(level) = self.level() else {
            return prefill;
        };
        let has_peer = |p: &Arc<Endpoint>| {
            p.domain(level)
                .is_some_and(|d| decode.iter().any(|e| e.domain(level) == Some(d)))
        };
        if prefill.iter().any(has_peer) {
            prefill.into_iter().filter(has_peer).collect()
        } else {
            prefill
        }
    }

    /// The decode workers `prefill` may transfer to (the runtime table), with their transfer
    /// costs for a prompt of `isl_tokens`.
    pub fn decode_candidates(
        &self,
        prefill: &Endpoint,
        decode: &[Arc<Endpoint>],
        isl_tokens: u64,
    ) -> Result<DecodeCandidates, PickError> {
        let mut crossed = false;
        let endpoints: Vec<Arc<Endpoint>> = match self.level() {
            None => decode.to_vec(),
            Some(level) => {
                let own = prefill.domain(level);
                let same: Vec<Arc<Endpoint>> = decode
                    .iter()
                    .filter(|e| own.is_some() && e.domain(level) == own)
                    .cloned()
                    .collect();
                if !same.is_empty() {
                    same
                } else {
                    match self.kv_transfer_mismatch_policy {
                        MismatchPolicy::Fail => {
                            return Err(PickError::TopologyMismatch {
                                level: level.to_owned(),
                                domain: own.map(str::to_owned),
                                prefill: prefill.name.to_string(),
                            })
                        }
                        MismatchPolicy::Fallback => {
                            tracing::warn!(level, domain = own, prefill = %prefill.name,
                                "no decode worker in the prefill worker's topology domain; kv_transfer_mismatch_policy is fallback: any decode worker may take the transfer");
                            crossed = true;
                            decode.to_vec()
                        }
                    }
                }
            }
        };
        let bias = if self.kv_transfer_weight > 0.0 {
            let bytes = isl_tokens as f64 * self.kv_bytes_per_token as f64;
            endpoints
                .iter()
                .map(|d| self.kv_transfer_weight * self.transfer_ms(prefill, d, bytes))
                .collect()
        } else {
            Vec::new()
        };
        Ok(DecodeCandidates {
            endpoints,
            bias,
            crossed,
        })
    }

    /// The link between two workers: the first level of the table whose value they share, else
    /// the cross-domain link; none for the same worker.
    pub fn link(&self, a: &Endpoint, b: &Endpoint) -> Option<LinkQos> {
        if a.addr == b.addr {
            return None;
        }
        Some(link_between(
            &self.transfer_qos,
            self.cross_domain_qos,
            &a.domains,
            &b.domains,
        ))
    }

    /// Milliseconds to move `bytes` of KV cache from `a` to `b`.
    pub fn transfer_ms(&self, a: &Endpoint, b: &Endpoint, bytes: f64) -> f64 {
        self.link(a, b).map_or(0.0, |l| l.transfer_ms(bytes))
    }
}

/// The link between two workers with domains `a` and `b`: the first level of `table` whose value
/// they share, else `cross`.
pub fn link_between(table: &[LevelQos], cross: LinkQos, a: &Domains, b: &Domains) -> LinkQos {
    table
        .iter()
        .find(|l| a.get(&l.level).is_some_and(|v| b.get(&l.level) == Some(v)))
        .map_or(cross, LevelQos::qos)
}
