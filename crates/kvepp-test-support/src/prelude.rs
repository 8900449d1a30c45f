//! What a test imports in one line: the harness's helpers and the fixtures' modules (and, with
//! the `epp` feature, kvepp in-process and the shipped manifests). Nothing in the crate imports
//! from here.

#[cfg(feature = "epp")]
pub use crate::epp::Epp;
pub use crate::harness::*;
#[cfg(feature = "epp")]
pub use crate::shipped;
pub use crate::{kube_api, publisher};
