//! `kvepp envoy-config`: an Envoy bootstrap for the pool kvepp serves, derived from the shipped
//! local bootstrap (`manifests/envoy/envoy-local.yaml`) and the InferencePool's picker reference.
//!
//! What the pool decides:
//! - `failureMode: FailClose` (the default): `failure_mode_allow: false`; a request kvepp cannot
//!   decide fails (the shipped file as it is);
//! - `failureMode: FailOpen`: `failure_mode_allow: true`, the request body BUFFERED (Envoy 1.40
//!   fails open in FULL_DUPLEX_STREAMED only before the first body chunk reached the processor),
//!   `route_cache_action: CLEAR`, and a second route: requests without a destination header go to
//!   `pool_fallback`, an ordinary cluster of the pool's ready endpoints at generation time.
//!
//! kvepp's own address is `127.0.0.1:<grpc_port>`; with `grpc_tls.mode: off` the TLS transport
//! socket is removed.

use std::net::SocketAddr;

use serde_yaml::Value;

use crate::discovery::FailureMode;

/// The shipped local bootstrap, the template.
pub(crate) const TEMPLATE: &str = include_str!("../manifests/envoy/envoy-local.yaml");

#[derive(Debug, thiserror::Error)]
pub enum EnvoyConfigError {
    #[error("the bootstrap template: {0}")]
    Template(#[from] serde_yaml::Error),
    #[error("the bootstrap template has no {0}")]
    Shape(&'static str),
    #[error("envoy-config reads the pool from --manifests-dir; none was given")]
    NoManifests,
    #[error("manifest file {0} does not parse")]
    BadManifest(String),
    #[error("InferencePool {0:?} is not in the manifests (or names another picker)")]
    NoPool(String),
    #[error("failureMode FailOpen needs the pool's ready endpoints for the fallback route; none are ready")]
    NoFallback,
}

/// What the generated bootstrap depends on.
#[derive(Debug, Clone)]
pub struct Inputs {
    pub failure_mode: FailureMode,
    /// The pool's ready endpoints (the fail-open route's cluster).
    pub endpoints: Vec<SocketAddr>,
    /// Where Envoy reaches kvepp's ext_proc port.
    pub epp: SocketAddr,
    /// Whether that port speaks TLS.
    pub tls: bool,
}

fn at<'a>(
    v: &'a mut Value,
    path: &[&str],
    what: &'static str,
) -> Result<&'a mut Value, EnvoyConfigError> {
    let mut cur = v;
    for key in path {
        cur = match key.parse::<usize>() {
            Ok(i) => cur.get_mut(i),
            Err(_) => cur.get_mut(*key),
        }
        .ok_or(EnvoyConfigError::Shape(what))?;
    }
    Ok(cur)
}

/// The inputs for the pool `cfg` serves, read once from `cfg.manifests_dir` (the pool object and
/// its ready endpoints, as `kvepp serve` would see them).
pub fn inputs_from(cfg: &crate::config::Config) -> Result<Inputs, EnvoyConfigError> {
    let dir = cfg
        .manifests_dir
        .as_ref()
        .ok_or(EnvoyConfigError::NoManifests)?;
    let bad = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let seen = bad.clone();
    let mut source =
        crate::discovery::ManifestDir::new(dir, std::time::Duration::from_secs(1), move |p| {
            let mut b = seen.lock();
            b.push(p.display().to_string());
        });
    let inventory = source.poll_once().unwrap_or_default();
    if let Some(file) = bad.lock().first().cloned() {
        return Err(EnvoyConfigError::BadManifest(file));
    }
    let store = crate::discovery::Datastore::new(
        crate::discovery::PoolRef {
            name: cfg.pool_name.clone(),
            namespace: cfg.pool_namespace.clone(),
            service: cfg.endpoint_service().to_owned(),
            picker_service: cfg.endpoint_picker_service.clone(),
        },
        |_| {},
    );
    store.apply(&inventory);
    let snap = store.snapshot();
    let pool = snap
        .pool
        .as_ref()
        .ok_or_else(|| EnvoyConfigError::NoPool(cfg.pool_name.clone()))?;
    Ok(Inputs {
        failure_mode: pool.failure_mode,
        endpoints: snap.endpoints.iter().map(|e| e.addr).collect(),
        epp: SocketAddr::from(([127, 0, 0, 1], cfg.grpc_port)),
        tls: cfg.grpc_tls.mode != crate::config::TlsMode::Off,
    })
}

/// The bootstrap for `inputs`.
pub fn bootstrap(inputs: &Inputs) -> Result<Value, EnvoyConfigError> {
    let mut b: Value = serde_yaml::from_str(TEMPLATE)?;
    let hcm = [
        "static_resources",
        "listeners",
        "0",
        "filter_chains",
        "0",
        "filters",
        "0",
        "typed_config",
    ];
    let ext_path: Vec<&str> = hcm
        .iter()
        .copied()
        .chain(["http_filters", "0", "typed_config"])
        .collect();
    let fail_open = inputs.failure_mode == FailureMode::FailOpen;
    {
        let ext = at(&mut b, &ext_path, "ext_proc filter")?;
        ext["failure_mode_allow"] = fail_open.into();
        if fail_open {
            ext["processing_mode"]["request_body_mode"] = "BUFFERED".into();
            ext["processing_mode"]["response_body_mode"] = "BUFFERED".into();
            ext["route_cache_action"] = "CLEAR".into();
        }
    }
    let clusters = at(&mut b, &["static_resources", "clusters"], "clusters")?;
    let kvepp = clusters
        .as_sequence_mut()
        .and_then(|c| c.iter_mut().find(|c| c["name"] == "kvepp"))
        .ok_or(EnvoyConfigError::Shape("kvepp cluster"))?;
    let addr = at(
        kvepp,
        &[
            "load_assignment",
            "endpoints",
            "0",
            "lb_endpoints",
            "0",
            "endpoint",
            "address",
            "socket_address",
        ],
        "kvepp cluster address",
    )?;
    addr["address"] = inputs.epp.ip().to_string().into();
    addr["port_value"] = u64::from(inputs.epp.port()).into();
    if !inputs.tls {
        if let Some(m) = kvepp.as_mapping_mut() {
            m.remove("transport_socket");
        }
    }
    if fail_open {
        if inputs.endpoints.is_empty() {
            return Err(EnvoyConfigError::NoFallback);
        }
        let routes: Value = serde_yaml::from_str(
            "- match: {prefix: \"/\", headers: [{name: x-gateway-destination-endpoint, present_match: true}]}\n  route: {cluster: inference_pool, timeout: 300s}\n# kvepp did not answer (failure_mode_allow): any ready endpoint, without KV-aware routing.\n- match: {prefix: \"/\"}\n  route: {cluster: pool_fallback, timeout: 300s}\n",
        )?;
        let hcm_path: Vec<&str> = hcm
            .iter()
            .copied()
            .chain(["route_config", "virtual_hosts", "0"])
            .collect();
        at(&mut b, &hcm_path, "virtual host")?["routes"] = routes;
        let lb_endpoints: Vec<Value> = inputs
            .endpoints
            .iter()
            .map(|a| {
                serde_yaml::from_str(&format!(
                    "endpoint: {{address: {{socket_address: {{address: \"{}\", port_value: {}}}}}}}",
                    a.ip(),
                    a.port()
                ))
            })
            .collect::<Result<_, _>>()?;
        let mut fallback: Value = serde_yaml::from_str(
            "name: pool_fallback\ntype: STATIC\nconnect_timeout: 5s\nload_assignment: {cluster_name: pool_fallback, endpoints: [{lb_endpoints: []}]}",
        )?;
        fallback["load_assignment"]["endpoints"][0]["lb_endpoints"] = lb_endpoints.into();
        at(&mut b, &["static_resources", "clusters"], "clusters")?
            .as_sequence_mut()
            .ok_or(EnvoyConfigError::Shape("clusters list"))?
            .push(fallback);
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(mode: FailureMode) -> Inputs {
        Inputs {
            failure_mode: mode,
            endpoints: vec!["10.0.0.1:8000".parse().unwrap()],
            epp: "127.0.0.1:9102".parse().unwrap(),
            tls: false,
        }
    }

    #[test]
    fn failure_mode_decides_fail_open_and_the_fallback_route() {
        let close = bootstrap(&inputs(FailureMode::FailClose)).unwrap();
        let text = serde_yaml::to_string(&close).unwrap();
        assert!(text.contains("failure_mode_allow: false"), "{text}");
        assert!(!text.contains("pool_fallback"));
        assert!(!text.contains("UpstreamTlsContext"), "tls off");
        assert!(text.contains("port_value: 9102"));
        let open = bootstrap(&inputs(FailureMode::FailOpen)).unwrap();
        let text = serde_yaml::to_string(&open).unwrap();
        assert!(text.contains("failure_mode_allow: true"));
        assert!(text.contains("request_body_mode: BUFFERED"));
        assert!(text.contains("route_cache_action: CLEAR"));
        assert!(text.contains("cluster: pool_fallback"));
        assert!(text.contains("address: 10.0.0.1"));
        let mut none = inputs(FailureMode::FailOpen);
        none.endpoints.clear();
        assert!(matches!(
            bootstrap(&none),
            Err(EnvoyConfigError::NoFallback)
        ));
    }
}
