//! Tools around kvepp that never ship in the EPP binary: a simulated fleet of inference engines
//! ([`fleet`]) and the routing-quality benchmark that replays workloads through Envoy and kvepp to
//! that fleet ([`mod@bench`]), the selection service's HTTP-overhead benchmark ([`select_bench`]),
//! replica sync's cost to a receiving replica ([`replica_bench`]) and a rolling upgrade of two
//! kvepp processes under load ([`rollout`]), generated Mooncake-format traces ([`tracegen`]), and
//! the simulator's parameters measured on a real engine ([`calibrate`]). `plotters` (and its font stack) lives only here.

pub mod bench;
pub mod calibrate;
pub mod fleet;
pub mod replica_bench;
pub mod rollout;
pub mod select_bench;
pub mod tracegen;
