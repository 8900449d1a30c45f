//! A model-server endpoint as the core sees it: its address and identity, its live load counters,
//! its role in a disaggregated pool and its topology domains, and the hints that let a pick find
//! its rows in the dense tables without hashing. Discovery builds these; every pick reads them.
//!
//! Invariants: `worker` is [`crate::types::worker_id`] of `addr_str` for a pool endpoint (the key of
//! its load and cached blocks), or the id a client registered for a rank-level candidate; an
//! endpoint's load counters are shared by every copy discovery makes of it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use crate::load::EndpointLoad;
use crate::types::WorkerRank;

/// What an endpoint does in a disaggregated pool (`/metadata` `role`, or the pod label the
/// worker-agent publishes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Role {
    /// Prefill and decode (an aggregated engine: the default).
    #[default]
    Both,
    Prefill,
    Decode,
}

impl Role {
    /// `prefill`, `decode`, `both` (llm-d's `llm-d.ai/role` values) and vLLM's KV-transfer roles
    /// (`kv_producer`, `kv_consumer`, `kv_both`); None for anything else.
    pub fn parse(s: &str) -> Option<Role> {
        match s.trim().to_ascii_lowercase().as_str() {
            "both" | "prefill_and_decode" | "prefill-decode" | "kv_both" | "" => Some(Role::Both),
            "prefill" | "kv_producer" => Some(Role::Prefill),
            "decode" | "kv_consumer" => Some(Role::Decode),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    pub fn prefills(self) -> bool {
        self != Role::Decode
    }

    pub fn decodes(self) -> bool {
        self != Role::Prefill
    }
}

/// Topology domains of an endpoint: level → value.
pub type Domains = BTreeMap<String, String>;

/// Where the KV-aware picker last found an endpoint in its dense tables (its rank-0 slot in the
/// KV-event index and in the approximate index, its id in the slot tracker): checked before use
/// and corrected when wrong, so a pick reads them instead of hashing the endpoint's identity.
///
/// The core's own cache, kept in the endpoint it describes: private to this crate (no other
/// layer reads or writes it, discovery builds endpoints through [`Endpoint::new`]), three words
/// per endpoint, and never trusted: a hint that names another endpoint's row is looked up again
/// and overwritten, so a stale or zero hint costs one hash lookup, never a wrong answer.
#[derive(Debug, Default)]
pub(crate) struct PickHints {
    pub(crate) index: [AtomicU32; 2],
    pub(crate) slot: AtomicU32,
}

/// A ready model-server endpoint as the selector sees it.
///
/// `worker` and `hints` come first and together (`repr(C)`): they are what a pick over
/// thousands of candidates reads from each, so they share one cache line.
#[derive(Debug)]
#[repr(C)]
pub struct Endpoint {
    /// [`crate::types::worker_id`] of `addr_str`, computed once: the key of its load and cached
    /// blocks in the KV-aware picker.
    pub worker: u64,
    pub(crate) hints: PickHints,
    pub addr: SocketAddr,
    /// `addr` formatted once as `ip:port` (what goes into headers, metadata and metric labels).
    pub addr_str: Arc<str>,
    /// Instance id (the Pod name from `targetRef`, else the address).
    pub name: Arc<str>,
    pub zone: Option<Arc<str>>,
    pub node: Option<Arc<str>>,
    /// The port named `metadata` in its EndpointSlice: where the engine serves `/metadata`.
    pub metadata_port: Option<u16>,
    /// Live load counters; shared across discovery updates for the same address.
    pub load: Arc<EndpointLoad>,
    /// Prefill, decode or both (from its metadata; both unless told).
    pub role: Role,
    /// Topology domains (level → value): its metadata's `topology_domains`, else the
    /// EndpointSlice's `zone` and `nodeName` as `zone` and `host`.
    pub domains: Domains,
    /// The data-parallel rank this endpoint is, when the pool lists one target port per rank.
    pub dp_rank: Option<u32>,
    /// None: a pool endpoint, booked on its worker's rank 0, its cached prefix the best over its
    /// worker's ranks. `Some(r)`: data-parallel rank `r` of a registered worker (the HTTP
    /// services' candidates), booked and matched on that rank alone.
    pub exact_rank: Option<u32>,
}

impl Endpoint {
    /// An endpoint at `addr` named `name`, with fresh load counters and no zone, node or metadata
    /// port (discovery fills those in itself).
    pub fn new(addr: SocketAddr, name: impl Into<Arc<str>>) -> Self {
        let addr_str: Arc<str> = addr.to_string().into();
        Endpoint {
            addr,
            worker: crate::types::worker_id(&addr_str),
            hints: PickHints::default(),
            addr_str,
            name: name.into(),
            zone: None,
            node: None,
            metadata_port: None,
            load: Arc::new(EndpointLoad::default()),
            role: Role::Both,
            domains: Domains::new(),
            dp_rank: None,
            exact_rank: None,
        }
    }

    /// The candidate for rank `rank` of a registered worker (the HTTP services): no network
    /// address (it is never sent to a proxy), named `name`.
    pub fn for_rank(rank: WorkerRank, name: impl Into<Arc<str>>) -> Self {
        let name: Arc<str> = name.into();
        Endpoint {
            worker: rank.worker,
            addr_str: name.clone(),
            exact_rank: Some(rank.dp_rank),
            ..Endpoint::new(SocketAddr::from(([0, 0, 0, 0], 0)), name)
        }
    }

    /// The slot-tracker rank this endpoint books (see [`Self::exact_rank`]).
    #[inline(always)]
    pub fn rank(&self) -> WorkerRank {
        WorkerRank {
            worker: self.worker,
            dp_rank: self.exact_rank.unwrap_or(0),
        }
    }

    /// The endpoint's value of topology level `level`, when it has one.
    pub fn domain(&self, level: &str) -> Option<&str> {
        self.domains.get(level).map(String::as_str)
    }
}
