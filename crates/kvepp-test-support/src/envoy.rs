//! A real Envoy process with the local bootstrap (`manifests/envoy/envoy-local.yaml`), its listener
//! and admin on ephemeral ports and its ext_proc cluster pointed at a kvepp.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use crate::client::fetch;
use crate::{wait_until, TempDir};

const BOOTSTRAP: &str = include_str!("../../../manifests/envoy/envoy-local.yaml");

/// Why Envoy could not be started.
#[derive(Debug, thiserror::Error)]
#[error("Envoy: {0}")]
pub struct EnvoyError(pub String);

#[derive(Debug)]
pub struct EnvoyProcess {
    pub listener: SocketAddr,
    pub admin: SocketAddr,
    child: tokio::process::Child,
    dir: TempDir,
}

impl EnvoyProcess {
    /// The local bootstrap, parsed.
    pub fn bootstrap() -> Result<serde_yaml::Value, EnvoyError> {
        serde_yaml::from_str(BOOTSTRAP).map_err(|e| EnvoyError(e.to_string()))
    }

    pub async fn start(bin: &Path, epp: SocketAddr) -> Result<Self, EnvoyError> {
        Self::start_with(bin, Self::bootstrap()?, epp).await
    }

    /// Starts Envoy with `b` (the local bootstrap, possibly adapted), its listener and admin moved
    /// to ephemeral ports and its `kvepp` cluster pointed at `epp`.
    pub async fn start_with(
        bin: &Path,
        mut b: serde_yaml::Value,
        epp: SocketAddr,
    ) -> Result<Self, EnvoyError> {
        let dir = TempDir::new("bench-envoy");
        b["admin"]["address"]["socket_address"]["port_value"] = 0.into();
        b["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = 0.into();
        let clusters = b["static_resources"]["clusters"]
            .as_sequence_mut()
            .ok_or_else(|| EnvoyError("bootstrap has no clusters".into()))?;
        for c in clusters.iter_mut().filter(|c| c["name"] == "kvepp") {
            let sa = &mut c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
                ["address"]["socket_address"];
            sa["address"] = epp.ip().to_string().into();
            sa["port_value"] = epp.port().into();
        }
        let config = dir.path().join("envoy.yaml");
        let admin_file = dir.path().join("admin.txt");
        let yaml = serde_yaml::to_string(&b).map_err(|e| EnvoyError(e.to_string()))?;
        std::fs::write(&config, yaml).map_err(|e| EnvoyError(e.to_string()))?;
        let log = std::fs::File::create(dir.path().join("envoy.log"))
            .map_err(|e| EnvoyError(e.to_string()))?;
        let child = tokio::process::Command::new(bin)
            .arg("-c")
            .arg(&config)
            .args([
                "--concurrency",
                "1",
                "--use-dynamic-base-id",
                "--disable-hot-restart",
            ])
            .args(["-l", "warning", "--admin-address-path"])
            .arg(&admin_file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| EnvoyError(format!("cannot run {}: {e}", bin.display())))?;
        let mut envoy = EnvoyProcess {
            listener: ([127, 0, 0, 1], 0).into(),
            admin: ([127, 0, 0, 1], 0).into(),
            child,
            dir,
        };
        let deadline = Duration::from_secs(30);
        envoy.admin = wait_until("Envoy's admin address", deadline, || async {
            std::fs::read_to_string(&admin_file)
                .ok()
                .and_then(|s| s.trim().parse().ok())
        })
        .await
        .map_err(|e| EnvoyError(format!("{e}; log: {}", envoy.log())))?;
        let admin = envoy.admin;
        envoy.listener = wait_until("Envoy's listener", deadline, || async move {
            let (status, _) = fetch(admin, "/ready").await.ok()?;
            if status != 200 {
                return None;
            }
            let (_, body) = fetch(admin, "/listeners?format=json").await.ok()?;
            let v: serde_json::Value = serde_json::from_str(&body).ok()?;
            let port = v["listener_statuses"][0]["local_address"]["socket_address"]["port_value"]
                .as_u64()?;
            (port != 0).then(|| SocketAddr::from(([127, 0, 0, 1], port as u16)))
        })
        .await
        .map_err(|e| EnvoyError(format!("{e}; log: {}", envoy.log())))?;
        Ok(envoy)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }

    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}
