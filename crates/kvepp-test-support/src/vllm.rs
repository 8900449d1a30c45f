//! Real vLLM engines (the CPU build installed by `scripts/install-vllm.sh`) serving the tiny model
//! `scripts/tiny_model.py` writes, each started through `scripts/vllm_engine.py`.
//!
//! Invariants: an engine never outlives the process that started it (the launcher ends the engine
//! when its standard input, held by [`VllmEngine`], closes: on drop, on [`VllmEngine::restart`], or
//! when this process exits however it exits); ports are chosen here and stay the engine's across
//! restarts, so what a pool or a subscriber knows of the engine stays valid.
//!
//! Everything here blocks (std processes and sockets): engines are shared by the tests of one
//! binary, each with its own async runtime, so nothing here belongs to any runtime.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// Why an engine is not serving.
#[derive(Debug, thiserror::Error)]
#[error("vLLM engine {name}: {message}")]
pub struct EngineError {
    pub name: String,
    pub message: String,
}

/// Where the engine's install and model are (under the repository's ignored `.venv/`).
#[derive(Debug, Clone)]
pub struct VllmInstall {
    /// The vLLM venv's python.
    pub python: PathBuf,
    /// The launcher script.
    pub launcher: PathBuf,
    /// The tiny model directory (tokenizer and `lora/` adapters inside).
    pub model: PathBuf,
}

impl VllmInstall {
    /// The install under `root` (a checkout), or an error naming the script that makes it.
    pub fn under(root: &Path) -> Result<Self, String> {
        let python = std::env::var_os("KVEPP_VLLM_PYTHON")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join(".venv/vllm/bin/python"));
        let model = std::env::var_os("KVEPP_VLLM_MODEL")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join(".venv/tiny-model"));
        if !python.exists() {
            return Err(format!(
                "no vLLM at {}: run scripts/install-vllm.sh (scripts/test.sh does)",
                python.display()
            ));
        }
        if !model.join("config.json").exists() {
            return Err(format!(
                "no tiny model at {}: run scripts/tiny_model.py (scripts/test.sh does)",
                model.display()
            ));
        }
        Ok(VllmInstall {
            python,
            launcher: root.join("scripts/vllm_engine.py"),
            model,
        })
    }

    /// The adapters the engines serve (the names of `model/lora/*`), sorted.
    pub fn adapters(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.model.join("lora"))
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }
}

/// How one engine is run.
#[derive(Debug, Clone)]
pub struct EngineSpec {
    pub name: String,
    /// The core its threads are bound to.
    pub cpu: Option<usize>,
    /// `--kv-cache-memory-bytes` (e.g. `12M`).
    pub kv_cache_bytes: String,
    pub max_num_seqs: u32,
    /// Arguments passed on to `vllm serve`.
    pub extra: Vec<String>,
}

/// One running engine.
#[derive(Debug)]
pub struct VllmEngine {
    pub spec: EngineSpec,
    /// The OpenAI server.
    pub http: SocketAddr,
    /// KV events: the engine's PUB socket binds this port on every interface.
    pub events_port: u16,
    /// The publisher's replay ROUTER (every batch it still buffers, from any sequence number).
    pub replay_port: u16,
    /// The engine's log file.
    pub log: PathBuf,
    install: VllmInstall,
    child: Child,
    stdin: Option<ChildStdin>,
    /// Times the engine was started (1 after [`VllmEngine::start`]).
    pub starts: u32,
}

/// A port free now, below the kernel's ephemeral range (32768 and up on Linux). An engine binds
/// its ports only when it has started, a minute or two later, and meanwhile its own processes
/// take ephemeral ports for their internal sockets: a port from that range, free when chosen, can
/// be one of them by then.
fn free_port_below_ephemeral_range() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    loop {
        // A random start (std's randomly keyed hasher), so concurrent choosers rarely meet.
        let r = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        let port = 20_000 + (r % 12_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
            && std::net::TcpListener::bind(("0.0.0.0", port)).is_ok()
        {
            return port;
        }
    }
}

impl VllmEngine {
    /// Launches the engine (without waiting for it: see [`VllmEngine::wait_healthy`]), its log in
    /// `log_dir`.
    pub fn start(
        install: &VllmInstall,
        spec: EngineSpec,
        log_dir: &Path,
    ) -> Result<Self, EngineError> {
        let http = SocketAddr::from(([127, 0, 0, 1], free_port_below_ephemeral_range()));
        let (events_port, replay_port) = (
            free_port_below_ephemeral_range(),
            free_port_below_ephemeral_range(),
        );
        let log = log_dir.join(format!("vllm-{}.log", spec.name));
        let ports = (http, events_port, replay_port);
        let (child, stdin) = Self::launch(install, &spec, ports, &log)?;
        Ok(VllmEngine {
            spec,
            http,
            events_port,
            replay_port,
            log,
            install: install.clone(),
            child,
            stdin: Some(stdin),
            starts: 1,
        })
    }

    fn launch(
        install: &VllmInstall,
        spec: &EngineSpec,
        (http, events_port, replay_port): (SocketAddr, u16, u16),
        log: &Path,
    ) -> Result<(Child, ChildStdin), EngineError> {
        let err = |message: String| EngineError {
            name: spec.name.clone(),
            message,
        };
        let mut cmd = Command::new(&install.python);
        cmd.arg(&install.launcher)
            .arg("--model")
            .arg(&install.model)
            .args(["--port", &http.port().to_string()])
            .args(["--kv-events-port", &events_port.to_string()])
            .args(["--kv-events-replay-port", &replay_port.to_string()])
            .args(["--kv-cache-bytes", &spec.kv_cache_bytes])
            .args(["--max-num-seqs", &spec.max_num_seqs.to_string()])
            .arg("--log")
            .arg(log);
        if let Some(cpu) = spec.cpu {
            cmd.args(["--cpu", &cpu.to_string()]);
        }
        if !spec.extra.is_empty() {
            cmd.arg("--").args(&spec.extra);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| err(format!("cannot run {}: {e}", install.python.display())))?;
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| err("no stdin pipe".into()))?;
        Ok((child, stdin))
    }

    /// Waits until `GET /health` answers 200, or fails with the log's tail when the engine exits
    /// or `deadline` passes.
    pub fn wait_healthy(&mut self, deadline: Duration) -> Result<Duration, EngineError> {
        let start = Instant::now();
        loop {
            if get(self.http, "/health").is_ok_and(|(s, _)| s == 200) {
                return Ok(start.elapsed());
            }
            let exited = self.child.try_wait().ok().flatten();
            if exited.is_some() || start.elapsed() > deadline {
                let why = match exited {
                    Some(status) => format!("exited ({status})"),
                    None => format!("not healthy within {deadline:?}"),
                };
                return Err(EngineError {
                    name: self.spec.name.clone(),
                    message: format!("{why}; log {}:\n{}", self.log.display(), self.log_tail(40)),
                });
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The last `lines` lines of the engine's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Stops the engine (its launcher sees its input close) and waits for it to exit.
    pub fn stop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }

    /// Stops the engine and starts it again on the same ports (a pod restarted in place),
    /// without waiting for it to be healthy.
    pub fn restart(&mut self) -> Result<(), EngineError> {
        self.stop();
        let (child, stdin) = Self::launch(
            &self.install,
            &self.spec,
            (self.http, self.events_port, self.replay_port),
            &self.log,
        )?;
        self.child = child;
        self.stdin = Some(stdin);
        self.starts += 1;
        Ok(())
    }

    /// `GET /metrics`.
    pub fn metrics(&self) -> Result<String, String> {
        match get(self.http, "/metrics") {
            Ok((200, body)) => Ok(body),
            Ok((status, _)) => Err(format!("/metrics: status {status}")),
            Err(e) => Err(format!("/metrics: {e}")),
        }
    }

    /// The sum of every series of `name` (no labels selected) on the engine's page.
    pub fn metric_sum(&self, name: &str) -> Result<f64, String> {
        let page = self.metrics()?;
        Ok(sum_series(&page, name))
    }
}

impl Drop for VllmEngine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The sum of every sample of metric `name` on a Prometheus text page.
pub fn sum_series(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let rest = match rest.as_bytes().first() {
                Some(b'{') => &rest[rest.find('}')? + 1..],
                Some(b' ') => rest,
                _ => return None,
            };
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .sum()
}

/// A blocking `GET path` on a fresh HTTP/1.1 connection (close-delimited), bounded to 5 s.
pub fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let t = Duration::from_secs(5);
    let mut s = TcpStream::connect_timeout(&addr, t)?;
    s.set_read_timeout(Some(t))?;
    s.set_write_timeout(Some(t))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other("no status line"))?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Ok((status, body))
}

/// The payload of a chunked body.
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_are_summed_across_labels() {
        let page =
            "# TYPE a counter\na_total{x=\"1\"} 2.0\na_total{x=\"2\"} 3.5\na_totalb 9\na_total 1\n";
        assert_eq!(sum_series(page, "a_total"), 6.5);
        assert_eq!(sum_series(page, "b"), 0.0);
    }

    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(dechunk("3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"), "abcde");
    }
}
