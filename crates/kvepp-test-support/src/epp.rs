//! kvepp itself, in-process on ephemeral ports, serving a pool from a manifests directory of its
//! own (the `epp` feature: it links the server).

use crate::harness::{http, wait_for, DEADLINE};
use crate::TempDir;
use kvepp::config::Config;
use std::net::SocketAddr;

pub struct Epp {
    pub grpc: SocketAddr,
    pub health: SocketAddr,
    pub metrics: SocketAddr,
    /// The selection service's and slot tracker's HTTP doors, when configured.
    pub select_service: Option<SocketAddr>,
    pub slot_tracker: Option<SocketAddr>,
    pub dir: TempDir,
    server: kvepp::server::InProcess,
}

impl Epp {
    /// Starts kvepp serving pool `pool` from a fresh manifests directory holding `manifests`.
    pub async fn start(manifests: &str, tweak: impl FnOnce(&mut Config)) -> Epp {
        let epp = Epp::start_unready(manifests, tweak).await;
        epp.wait_ready().await;
        epp
    }

    /// As [`Epp::start`], without waiting for readiness (the pool may not be loaded).
    pub async fn start_unready(manifests: &str, tweak: impl FnOnce(&mut Config)) -> Epp {
        let dir = TempDir::new("epp");
        std::fs::write(dir.path().join("pool.yaml"), manifests).expect("write manifests");
        let mut cfg = Config {
            bind_address: std::net::Ipv4Addr::LOCALHOST.into(),
            grpc_port: 0,
            grpc_health_port: 0,
            metrics_port: 0,
            pool_name: "pool".into(),
            manifests_dir: Some(dir.path().to_owned()),
            manifests_poll_ms: 20,
            shutdown_grace_seconds: 2,
            // In-process: nothing health-checks it, so stopping need not wait.
            shutdown_delay_ms: 0,
            ..Config::default()
        };
        tweak(&mut cfg);
        cfg.validate().expect("valid test config");
        let server = kvepp::server::InProcess::start(cfg).await.expect("bind");
        Epp {
            grpc: server.grpc,
            health: server.health,
            metrics: server.metrics,
            select_service: server.select_service,
            slot_tracker: server.slot_tracker,
            dir,
            server,
        }
    }

    pub async fn wait_ready(&self) {
        let addr = self.metrics;
        // A refused or reset connection (the listener's backlog full on a loaded machine) is
        // not ready yet: asked again.
        wait_for("kvepp /ready", || async move {
            let headers = [("host", "test")];
            let ask = crate::client::request(addr, "GET", "/ready", &headers, Default::default());
            let r = tokio::time::timeout(DEADLINE, ask).await.ok()?.ok()?;
            (r.status().as_u16() == 200).then_some(())
        })
        .await;
    }

    pub fn write_manifest(&self, file: &str, text: &str) {
        // Write then rename, so the poller never sees a half-written file.
        let tmp = self.dir.path().join(format!(".{file}.tmp"));
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, self.dir.path().join(file)).expect("rename");
    }

    pub async fn metrics_text(&self) -> String {
        String::from_utf8(
            http(self.metrics, "GET", "/metrics", &[], "")
                .await
                .body
                .to_vec(),
        )
        .expect("utf8")
    }

    /// The value of one metric line (exact series text before the value), if present.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        crate::find_sample(&self.metrics_text().await, series)
    }

    pub async fn stop(self) {
        tokio::time::timeout(DEADLINE, self.server.stop())
            .await
            .expect("kvepp stops in time")
            .expect("kvepp run");
    }
}

/// Waits until the gRPC health service on 127.0.0.1:`port` reports every service kvepp serves
/// (`liveness`, `readiness`, the ext_proc service) as SERVING.
pub async fn wait_health_serving(port: u16) {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let addr = format!("http://127.0.0.1:{port}");
    let client = wait_for("gRPC health up", || {
        let a = addr.clone();
        async move {
            Some(HealthClient::new(
                tonic::transport::Endpoint::from_shared(a)
                    .ok()?
                    .connect()
                    .await
                    .ok()?,
            ))
        }
    })
    .await;
    for service in [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        wait_for(service, || {
            let mut client = client.clone();
            async move {
                let r = client
                    .check(HealthCheckRequest {
                        service: service.into(),
                    })
                    .await
                    .ok()?
                    .into_inner();
                (r.status == ServingStatus::Serving as i32).then_some(())
            }
        })
        .await;
    }
}
