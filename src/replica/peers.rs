//! The replica-sync peer list: ZMQ endpoints added by flags, at run time (the HTTP services'
//! `/replica_sync/*` routes) and by discovery (`kvepp serve`'s own Service).
//!
//! Invariants: endpoints are `tcp://host:port` (or `ipc://`/`inproc://` paths), at most
//! [`MAX_PEERS`], never the service's own advertised endpoint; the list is in memory only (after a
//! restart, only the flags' peers return). Connecting to them is replica sync's job: this list is
//! what it connects to, following its changes.

use parking_lot::{Mutex, MutexGuard};
use std::collections::BTreeSet;

use tokio::sync::watch;

/// Why the peer list refused a change (the HTTP routes answer 400, 429 or 404).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    #[error("{0}")]
    Invalid(String),
    #[error("{MAX_PEERS} peers are configured, the limit")]
    TooMany,
    #[error("{0} is not a configured peer")]
    Unknown(String),
}

pub(crate) const MAX_PEERS: usize = 256;

#[derive(Debug, Default)]
pub struct Peers {
    list: BTreeSet<String>,
    /// Peers found by discovery (kvepp's own Service), replaced as a whole.
    discovered: BTreeSet<String>,
    /// The local endpoint as peers reach it (never registered as a peer).
    advertise: Option<String>,
}

/// Checks the shape of a ZMQ endpoint.
pub(crate) fn validate_endpoint(endpoint: &str) -> Result<(), String> {
    let endpoint = endpoint.trim();
    if let Some(rest) = endpoint.strip_prefix("tcp://") {
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| format!("{endpoint:?}: expected tcp://host:port"))?;
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(format!("{endpoint:?}: expected tcp://host:port"));
        }
        return Ok(());
    }
    if endpoint.starts_with("ipc://") || endpoint.starts_with("inproc://") {
        return Ok(());
    }
    Err(format!(
        "{endpoint:?}: expected a ZMQ endpoint (tcp://host:port)"
    ))
}

impl Peers {
    /// The flags' peers (validated) and the advertised local endpoint.
    pub fn new(
        initial: impl IntoIterator<Item = String>,
        advertise: Option<String>,
    ) -> Result<Self, String> {
        let mut p = Peers {
            list: BTreeSet::new(),
            discovered: BTreeSet::new(),
            advertise,
        };
        for e in initial {
            p.add(&e).map_err(|e| e.to_string())?;
        }
        Ok(p)
    }

    pub(crate) fn add(&mut self, endpoint: &str) -> Result<(), PeerError> {
        validate_endpoint(endpoint).map_err(PeerError::Invalid)?;
        let endpoint = endpoint.trim();
        if self.advertise.as_deref() == Some(endpoint) {
            return Err(PeerError::Invalid(format!(
                "{endpoint} is this process's own advertised endpoint"
            )));
        }
        if !self.list.contains(endpoint) && self.list.len() >= MAX_PEERS {
            return Err(PeerError::TooMany);
        }
        self.list.insert(endpoint.to_owned());
        Ok(())
    }

    /// Removes a peer; whether it was configured.
    pub(crate) fn remove(&mut self, endpoint: &str) -> bool {
        self.list.remove(endpoint.trim())
    }

    /// Configured and discovered peers, sorted.
    pub(crate) fn list(&self) -> Vec<String> {
        self.list.union(&self.discovered).cloned().collect()
    }

    /// Replaces the discovered peers (never the advertised self), bounded like the rest.
    pub(crate) fn set_discovered(&mut self, found: impl IntoIterator<Item = String>) {
        self.discovered = found
            .into_iter()
            .filter(|e| self.advertise.as_deref() != Some(e.as_str()))
            .take(MAX_PEERS)
            .collect();
    }
}

/// The peer list as the routes share it: what `register_peer`, `deregister_peer` and `peers`
/// answer, whatever the body's field is called; replica sync follows its changes
/// ([`SharedPeers::subscribe`]).
#[derive(Debug)]
pub struct SharedPeers {
    peers: Mutex<Peers>,
    changes: watch::Sender<Vec<String>>,
}

impl Default for SharedPeers {
    fn default() -> Self {
        SharedPeers::new(Peers::default())
    }
}

impl SharedPeers {
    pub fn new(peers: Peers) -> Self {
        let changes = watch::channel(peers.list()).0;
        SharedPeers {
            peers: Mutex::new(peers),
            changes,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Peers> {
        self.peers.lock()
    }

    /// The list now and at every change.
    pub(crate) fn subscribe(&self) -> watch::Receiver<Vec<String>> {
        self.changes.subscribe()
    }

    /// Adds a peer (the `register_peer` route).
    pub(crate) fn register(&self, endpoint: &str) -> Result<(), PeerError> {
        let mut peers = self.lock();
        peers.add(endpoint)?;
        self.changes.send_replace(peers.list());
        tracing::info!(peer = endpoint, "replica sync peer registered");
        Ok(())
    }

    /// Removes a peer (the `deregister_peer` route).
    pub(crate) fn deregister(&self, endpoint: &str) -> Result<(), PeerError> {
        let mut peers = self.lock();
        if peers.remove(endpoint) {
            self.changes.send_replace(peers.list());
            Ok(())
        } else {
            Err(PeerError::Unknown(endpoint.to_owned()))
        }
    }

    /// Replaces the peers found by discovery.
    pub(crate) fn set_discovered(&self, found: impl IntoIterator<Item = String>) {
        let mut peers = self.lock();
        peers.set_discovered(found);
        self.changes.send_replace(peers.list());
    }

    /// The sorted list.
    pub(crate) fn list(&self) -> Vec<String> {
        self.lock().list()
    }
}

/// `a,b,c` → validated endpoints (empty items skipped).
pub(crate) fn parse_list(s: Option<&str>) -> Vec<String> {
    s.unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_are_validated_sorted_and_never_self() {
        let mut p = Peers::new(
            parse_list(Some("tcp://b:9092, tcp://a:9092")),
            Some("tcp://me:9092".into()),
        )
        .unwrap();
        assert_eq!(p.list(), ["tcp://a:9092", "tcp://b:9092"]);
        assert!(p.add("tcp://me:9092").is_err());
        assert!(p.add("http://x:1").is_err());
        assert!(p.add("tcp://x").is_err());
        assert!(p.add("tcp://x:99999").is_err());
        p.add("tcp://c:1").unwrap();
        assert!(p.remove("tcp://a:9092"));
        assert!(!p.remove("tcp://a:9092"));
        assert_eq!(p.list(), ["tcp://b:9092", "tcp://c:1"]);
        assert!(Peers::new(vec!["nope".into()], None).is_err());
    }
}
