//! Stamps the build with the git commit, for `kvepp --version`, the startup log and the
//! `kvepp_build_info` metric, and compiles kvepp's own protos (`proto/kvepp`) with prost and a
//! vendored `protoc`. Envoy's protos need no code generation here: they come pre-generated from the
//! `envoy-types` crate (see proto/README.md).

use std::process::Command;

fn main() {
    compile_protos();
    // A build without the repository (a container build) passes the commit in KVEPP_GIT_SHA.
    println!("cargo:rerun-if-env-changed=KVEPP_GIT_SHA");
    let sha = std::env::var("KVEPP_GIT_SHA")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(git_sha)
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

/// The checkout's commit, when built from a git checkout.
fn git_sha() -> Option<String> {
    Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// `proto/kvepp/replica/v1/replica.proto` → `$OUT_DIR/kvepp.replica.v1.rs`. Failing to find or run
/// protoc fails the build with the reason (a build script may panic: it is the build's error path).
fn compile_protos() {
    const PROTO: &str = "proto/kvepp/replica/v1/replica.proto";
    println!("cargo:rerun-if-changed={PROTO}");
    match protoc_bin_vendored::protoc_bin_path() {
        Ok(protoc) => std::env::set_var("PROTOC", protoc),
        Err(e) => println!("cargo:warning=no vendored protoc for this platform ({e}); using PROTOC or protoc from PATH"),
    }
    if let Err(e) = prost_build::Config::new().compile_protos(&[PROTO], &["proto"]) {
        panic!("compiling {PROTO}: {e}");
    }
}
