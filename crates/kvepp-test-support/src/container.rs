//! kvepp's container images run with podman, as `scripts/image.sh` built them.
//!
//! `CONTAINER_ENGINE_FLAGS` (the global flags `scripts/image.sh` built with, e.g.
//! `--storage-driver vfs`) select the same image store. Containers run with the `runc` runtime,
//! cgroupfs and no default ulimits, which also work in sandboxes that refuse crun's cgroup layout
//! or raising limits.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::TempDir;

/// The tag `scripts/image.sh` gives an image (`kvepp/kvepp` or `kvepp/worker-agent`) at the
/// workspace's version; podman stores it under `localhost/`.
pub fn image(name: &str) -> String {
    format!("localhost/{name}:{}", env!("CARGO_PKG_VERSION"))
}

/// podman with the image store of `scripts/image.sh` and a containers.conf without default
/// ulimits.
pub struct Podman {
    flags: Vec<String>,
    conf: PathBuf,
    _dir: TempDir,
}

impl Podman {
    pub fn new() -> Podman {
        let dir = TempDir::new("podman");
        let conf = dir.path().join("containers.conf");
        std::fs::write(&conf, "[containers]\ndefault_ulimits = []\n").expect("containers.conf");
        let flags = std::env::var("CONTAINER_ENGINE_FLAGS")
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        Podman {
            flags,
            conf,
            _dir: dir,
        }
    }

    /// `podman <global flags> args…`, ready to run.
    pub fn command<I, S>(&self, args: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        let mut c = Command::new("podman");
        c.env("CONTAINERS_CONF", &self.conf)
            .args(&self.flags)
            .args(["--runtime", "runc", "--cgroup-manager", "cgroupfs"])
            .args(args);
        c
    }

    /// `podman image inspect --format format image`, or an error naming the script that builds
    /// the image.
    pub fn inspect(&self, image: &str, format: &str) -> Result<String, String> {
        let out = self
            .command(["image", "inspect", "--format", format, image])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("podman: {e}: install podman (scripts/image.sh does)"))?;
        if !out.status.success() {
            return Err(format!(
                "no image {image}: run scripts/image.sh (scripts/test.sh does) with the same CONTAINER_ENGINE_FLAGS: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }
}

impl Default for Podman {
    fn default() -> Self {
        Podman::new()
    }
}
