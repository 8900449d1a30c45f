//! `grpc_tls`: TLS of the ext_proc port (mode, certificate files, client CA, plaintext beside
//! it) and the consistency rules between those fields.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Where the ext_proc port's TLS certificate comes from.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    clap::ValueEnum,
    schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum TlsMode {
    /// A self-signed certificate generated at each start (the reference EPP's default); the proxy
    /// encrypts but does not verify it.
    #[default]
    SelfSigned,
    /// `cert_file` and `key_file` (PEM), e.g. a mounted cert-manager Secret.
    Files,
    /// Plaintext HTTP/2 (h2c).
    Off,
}

/// TLS of the ext_proc gRPC port. The gRPC health port stays plaintext (kubelet's gRPC probes
/// cannot speak TLS) and binds `admin_bind_address`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcTls {
    /// `self-signed` (a certificate generated at start), `files` (`cert_file`, `key_file`) or `off` (plaintext h2c).
    pub mode: TlsMode,
    /// PEM certificate chain (mode `files`).
    pub cert_file: Option<PathBuf>,
    /// PEM private key (mode `files`).
    pub key_file: Option<PathBuf>,
    /// PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS; needs
    /// `accept_plaintext: false`).
    pub client_ca_file: Option<PathBuf>,
    /// Also serve plaintext HTTP/2 (h2c) on the same port, told apart from TLS by the first byte,
    /// so proxies configured for h2c keep working; `false` refuses them.
    pub accept_plaintext: bool,
}

impl Default for GrpcTls {
    fn default() -> Self {
        GrpcTls {
            mode: TlsMode::SelfSigned,
            cert_file: None,
            key_file: None,
            client_ca_file: None,
            accept_plaintext: true,
        }
    }
}

impl GrpcTls {
    pub(super) fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        let file = |name: &str, f: &Option<PathBuf>, out: &mut Vec<String>| match f {
            Some(p) if !p.is_file() => out.push(format!("{name} {} is not a file", p.display())),
            _ => {}
        };
        match self.mode {
            TlsMode::Files => {
                if self.cert_file.is_none() || self.key_file.is_none() {
                    out.push("mode files needs cert_file and key_file".into());
                }
                file("cert_file", &self.cert_file, &mut out);
                file("key_file", &self.key_file, &mut out);
            }
            TlsMode::SelfSigned | TlsMode::Off => {
                if self.cert_file.is_some() || self.key_file.is_some() {
                    out.push(format!(
                        "cert_file and key_file are only read in mode files (mode is {})",
                        serde_json::to_string(&self.mode).unwrap_or_default()
                    ));
                }
            }
        }
        if self.mode == TlsMode::Off && self.client_ca_file.is_some() {
            out.push("client_ca_file needs TLS (mode self-signed or files)".into());
        }
        if self.client_ca_file.is_some() && self.accept_plaintext {
            out.push(
                "client_ca_file makes client certificates mandatory: set accept_plaintext: false"
                    .into(),
            );
        }
        if self.mode == TlsMode::Off && !self.accept_plaintext {
            out.push("mode off serves plaintext only: accept_plaintext must be true".into());
        }
        file("client_ca_file", &self.client_ca_file, &mut out);
        out
    }
}
