//! kvepp's benchmark drivers, each through a real Envoy and kvepp in front of the simulated fleet
//! (`kvepp-sim`), run by the `kvepp-bench` binary: routing quality per policy ([`routing`], with adapter and session affinity in
//! [`routing::affinity`]), the selection service's HTTP overhead ([`select`]), replica sync's cost
//! to a receiving replica ([`replica`]) and a rolling upgrade of two kvepp processes under load
//! ([`rollout`]). `plotters` (and its font stack) lives only here.

pub mod replica;
pub mod rollout;
pub mod routing;
pub mod select;
