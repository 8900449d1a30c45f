//! A KV-event publisher that behaves like vLLM's (pyzmq, libzmq underneath), with a replay
//! socket, driven line by line (`tests/fixtures/kv_events/publisher.py`).

use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use crate::harness::{repo_root, DEADLINE};

/// The pyzmq publisher process (PUB and replay ROUTER on 127.0.0.1).
pub struct Publisher {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl Publisher {
    pub async fn start(port: u16, replay: u16, framing: &str) -> Publisher {
        let python = repo_root().join(".venv/bin/python");
        assert!(
            python.exists(),
            "{} missing: run scripts/test.sh (installs pyzmq)",
            python.display()
        );
        let mut child = Command::new(python)
            .arg(repo_root().join("tests/fixtures/kv_events/publisher.py"))
            .args([port.to_string(), replay.to_string(), framing.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn publisher");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let mut p = Publisher {
            child,
            stdin,
            stdout,
        };
        p.expect("ready").await;
        p
    }

    pub async fn expect(&mut self, word: &str) {
        let line = tokio::time::timeout(DEADLINE, self.stdout.next_line())
            .await
            .expect("publisher answers in time");
        assert_eq!(
            line.expect("read").as_deref(),
            Some(word),
            "publisher said something else"
        );
    }

    pub async fn cmd(&mut self, line: &str) {
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .expect("write");
        self.stdin.flush().await.expect("flush");
        self.expect("ok").await;
    }

    pub async fn quit(mut self) {
        self.cmd("quit").await;
        let _ = self.child.wait().await;
    }
}

impl Publisher {
    /// Publishes `payload` as batch `seq` (and keeps it for replay).
    pub async fn publish(&mut self, seq: u64, payload: &[u8]) {
        let hex: String = payload.iter().map(|b| format!("{b:02x}")).collect();
        self.cmd(&format!("pubhex {seq} {hex}")).await;
    }
}
