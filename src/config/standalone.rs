//! The standalone HTTP services' sections of the configuration tree: `select_service`
//! (`kvepp select-service`) and `slot_tracker` (`kvepp slot-tracker`). Each service loads the same
//! tree as `kvepp serve` (defaults here → `--config FILE` → `KVEPP_*` environment → the
//! services' flags, whose names stay Dynamo's), and reads its own section, `router` (with the `DYN_ROUTER_*`
//! variables) and `api_token_file` from it.
//!
//! Invariants: every default is written once, here; [`Config::validate_select_service`] and
//! [`Config::validate_slot_tracker`] report one message per bad field, naming the flag that sets
//! it.

use std::net::{IpAddr, Ipv4Addr};

use serde::{Deserialize, Serialize};

use super::{Config, FieldError};
use crate::replica::peers::{validate_endpoint, Peers};

/// `kvepp select-service`'s port when none is given (Dynamo's).
pub(crate) const SELECT_SERVICE_PORT: u16 = 8092;
/// `kvepp select-service`'s runtime threads when none are given (`--threads`).
pub(crate) const SELECT_SERVICE_THREADS: usize = 4;
/// `kvepp slot-tracker`'s port when none is given (Dynamo's).
pub(crate) const SLOT_TRACKER_PORT: u16 = 8091;

/// `select_service`: the standalone selection service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SelectServiceConfig {
    /// HTTP port (`--port`).
    pub port: u16,
    /// Runtime worker threads (`--threads`).
    pub threads: usize,
    /// Address the HTTP port binds (`--host`): loopback unless told otherwise.
    pub host: IpAddr,
    /// HTTP URLs whose `/dump` the KV index is recovered from at start (`--indexer-peers`).
    pub indexer_peers: Vec<String>,
    /// Local ZMQ PUB port for replica sync (`--replica-sync-port`, binds `tcp://*:<port>`).
    pub replica_sync_port: Option<u16>,
    /// Peers' ZMQ PUB endpoints (`--replica-sync-peers`); needs `replica_sync_port`.
    pub replica_sync_peers: Vec<String>,
}

impl Default for SelectServiceConfig {
    fn default() -> Self {
        SelectServiceConfig {
            port: SELECT_SERVICE_PORT,
            threads: SELECT_SERVICE_THREADS,
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            indexer_peers: Vec::new(),
            replica_sync_port: None,
            replica_sync_peers: Vec::new(),
        }
    }
}

/// `slot_tracker`: the standalone slot tracker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SlotTrackerConfig {
    /// HTTP port (`--port`).
    pub port: u16,
    /// Address the HTTP port binds (`--host`): loopback unless told otherwise.
    pub host: IpAddr,
    /// ZMQ PUB endpoint bound for replica sync (`--replica-sync-bind`, e.g. `tcp://*:8092`).
    pub replica_sync_bind: Option<String>,
    /// The bound endpoint as peers reach it, never taken as a peer (`--replica-sync-advertise`).
    pub replica_sync_advertise: Option<String>,
    /// Peers' ZMQ PUB endpoints (`--replica-sync-peers`); needs `replica_sync_bind`.
    pub replica_sync_peers: Vec<String>,
}

impl Default for SlotTrackerConfig {
    fn default() -> Self {
        SlotTrackerConfig {
            port: SLOT_TRACKER_PORT,
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            replica_sync_bind: None,
            replica_sync_advertise: None,
            replica_sync_peers: Vec::new(),
        }
    }
}

impl SelectServiceConfig {
    /// The peer list the flags and file seed.
    pub(crate) fn peers(&self) -> Result<Peers, String> {
        Peers::new(self.replica_sync_peers.iter().cloned(), None)
    }

    pub(super) fn problems(&self, bad: &mut dyn FnMut(&'static str, String)) {
        if !(1..=1024).contains(&self.threads) {
            bad(
                "select_service.threads",
                format!("--threads {} must be between 1 and 1024", self.threads),
            );
        }
        for url in &self.indexer_peers {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                bad(
                    "select_service.indexer_peers",
                    format!("--indexer-peers: {url:?} is not an http(s) URL"),
                );
            }
        }
        if self.replica_sync_port.is_none() && !self.replica_sync_peers.is_empty() {
            bad(
                "select_service.replica_sync_peers",
                "--replica-sync-peers requires --replica-sync-port".into(),
            );
        }
        if let Err(e) = self.peers() {
            bad(
                "select_service.replica_sync_peers",
                format!("--replica-sync-peers: {e}"),
            );
        }
    }
}

impl SlotTrackerConfig {
    /// The peer list the flags and file seed.
    pub(crate) fn peers(&self) -> Result<Peers, String> {
        Peers::new(
            self.replica_sync_peers.iter().cloned(),
            self.replica_sync_advertise.clone(),
        )
    }

    pub(super) fn problems(&self, bad: &mut dyn FnMut(&'static str, String)) {
        for (field, flag, v) in [
            (
                "slot_tracker.replica_sync_bind",
                "--replica-sync-bind",
                &self.replica_sync_bind,
            ),
            (
                "slot_tracker.replica_sync_advertise",
                "--replica-sync-advertise",
                &self.replica_sync_advertise,
            ),
        ] {
            if let Some(e) = v {
                let probe = e.replace("tcp://*:", "tcp://0.0.0.0:");
                if let Err(m) = validate_endpoint(&probe) {
                    bad(field, format!("{flag}: {m}"));
                }
            }
        }
        if self.replica_sync_bind.is_none()
            && (self.replica_sync_advertise.is_some() || !self.replica_sync_peers.is_empty())
        {
            bad(
                "slot_tracker.replica_sync_bind",
                "--replica-sync-advertise and --replica-sync-peers require --replica-sync-bind"
                    .into(),
            );
        }
        if let Err(e) = self.peers() {
            bad(
                "slot_tracker.replica_sync_peers",
                format!("--replica-sync-peers: {e}"),
            );
        }
    }
}

impl Config {
    /// Checks what `kvepp select-service` reads: its section, `router`, `api_token_file`.
    pub(crate) fn validate_select_service(&self) -> Result<(), Vec<FieldError>> {
        self.check_service(|bad| self.select_service.problems(bad))
    }

    /// Checks what `kvepp slot-tracker` reads: its section, `router`, `api_token_file`.
    pub(crate) fn validate_slot_tracker(&self) -> Result<(), Vec<FieldError>> {
        self.check_service(|bad| self.slot_tracker.problems(bad))
    }

    fn check_service(
        &self,
        section: impl FnOnce(&mut dyn FnMut(&'static str, String)),
    ) -> Result<(), Vec<FieldError>> {
        let mut errs = Vec::new();
        let mut bad =
            |field: &'static str, message: String| errs.push(FieldError { field, message });
        section(&mut bad);
        self.shared_problems(&mut bad);
        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_sections_report_every_bad_field_naming_its_flag() {
        let mut c = Config::default();
        assert!(c.validate_select_service().is_ok());
        assert!(c.validate_slot_tracker().is_ok());
        c.select_service.threads = 0;
        c.select_service.indexer_peers = vec!["ftp://x".into()];
        c.select_service.replica_sync_peers = vec!["tcp://b:1".into()];
        let errs = c.validate_select_service().unwrap_err();
        assert_eq!(errs.len(), 3, "{errs:?}");
        assert!(errs[2].message.contains("--replica-sync-port"), "{errs:?}");
        c.slot_tracker.replica_sync_peers = vec!["udp://b".into()];
        let errs = c.validate_slot_tracker().unwrap_err();
        assert_eq!(errs.len(), 2, "{errs:?}");
        assert!(errs[0].message.contains("--replica-sync-bind"), "{errs:?}");
        assert!(errs[1].message.contains("--replica-sync-peers"), "{errs:?}");
    }

    #[test]
    fn sections_come_from_the_file() {
        let c: Config = serde_yaml::from_str(
            "select_service: {port: 7000, threads: 2}\nslot_tracker: {port: 7001}\n",
        )
        .unwrap();
        assert_eq!((c.select_service.port, c.select_service.threads), (7000, 2));
        assert_eq!(c.slot_tracker.port, 7001);
        assert!(serde_yaml::from_str::<Config>("select_service: {prot: 1}\n").is_err());
    }
}
