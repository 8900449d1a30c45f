//! Stamps the build with the git commit, for `kvepp --version`, the startup log and the
//! `kvepp_build_info` metric. Envoy's protos need no code generation here: they come pre-generated
//! from the `envoy-types` crate (see proto/README.md).

use std::process::Command;

fn main() {
    let sha = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=KVEPP_GIT_SHA={sha}");
    // Re-stamp when HEAD moves, without re-running on every source change.
    for path in [".git/HEAD", ".git/refs/heads"] {
        if std::path::Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
