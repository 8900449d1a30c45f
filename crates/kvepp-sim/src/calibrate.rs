//! `kvepp-sim calibrate`: measures a real engine (vLLM's OpenAI server) and writes the simulator's
//! parameters ([`SimParams`]) for it, so the simulated fleet stands for that engine and model.
//!
//! What is measured, each probe a median of `--repeats` streamed completions of token-id prompts
//! (fresh ids every time, so nothing is cached unless a probe means it to be):
//! - block size and KV capacity: `vllm:cache_config_info` (`block_size`, `num_gpu_blocks`);
//! - prefill: time to first token of uncached prompts of several lengths (one output token), fitted
//!   as `step + a·n + c·n²` (least squares): `a` is the cost per uncached token, `c` the attention
//!   term (`prefill_us_per_token_per_kctx = 2000·c`: the mean context before a token is n/2);
//! - a cached prompt (the same prompt again): its time to first token, reported beside the fit's
//!   step as a check of the cached path (one block recomputed);
//! - decode: the mean gap between streamed tokens at batch 1 with a short context (one step:
//!   overhead + one sequence), at batch `--batch` (the per-sequence cost) and at batch 1 with a
//!   long context (the per-1,000-context-tokens cost).
//!
//! The engine's scheduler limits (`--max-num-seqs`, `--max-num-batched-tokens`) are not on its
//! metrics page: they are taken from the flags, as the engine was started.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;

use crate::client::{completion, Outcome};
use crate::fleet::SimParams;

#[derive(Debug, Clone, clap::Args)]
pub struct CalibrateArgs {
    /// The engine's OpenAI server (`host:port`).
    #[arg(long)]
    pub engine: SocketAddr,
    /// The model name it serves.
    #[arg(long, default_value = "m")]
    pub model: String,
    /// Its `--max-num-seqs`.
    #[arg(long, default_value_t = 8)]
    pub max_num_seqs: usize,
    /// Its `--max-num-batched-tokens`.
    #[arg(long, default_value_t = 4096)]
    pub max_num_batched_tokens: u64,
    /// Prompt lengths of the prefill probes (tokens).
    #[arg(long, value_delimiter = ',', default_value = "128,512,1024,1536")]
    pub prefill_lengths: Vec<u32>,
    /// Concurrent sequences of the batched decode probe.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Context of the long-context decode probe (tokens).
    #[arg(long, default_value_t = 1536)]
    pub long_context: u32,
    /// Output tokens of each decode probe.
    #[arg(long, default_value_t = 48)]
    pub decode_tokens: u32,
    /// Repeats of each probe (the median is kept).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Where to write the parameters (YAML); `-` for standard output.
    #[arg(long, default_value = "-")]
    pub out: PathBuf,
}

/// What the probes measured, in microseconds (printed beside the parameters).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Measured {
    /// (prompt tokens, median time to first token) of each uncached prefill probe.
    pub prefill_ttft_us: Vec<(u32, f64)>,
    /// The longest probe's prompt again, cached.
    pub cached_ttft_us: f64,
    pub decode_step_batch1_us: f64,
    pub decode_step_batch_us: f64,
    pub decode_step_long_us: f64,
}

/// Fresh token ids (`n` of them, never sent before by this process).
fn fresh_ids(n: u32) -> Vec<u32> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let base = 1_000 + NEXT.fetch_add(n, Ordering::Relaxed) % 90_000;
    let salt = fastrand::u32(0..20_000);
    (0..n)
        .map(|i| 1_000 + (base + salt + i * 7) % 100_000)
        .collect()
}

fn body(model: &str, ids: &[u32], max_tokens: u32) -> Bytes {
    Bytes::from(
        serde_json::json!({"model": model, "prompt": ids, "max_tokens": max_tokens,
            "stream": true, "stream_options": {"include_usage": true},
            "ignore_eos": true, "temperature": 0})
        .to_string(),
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn ok(o: &Outcome) -> anyhow::Result<(Duration, Duration, u64)> {
    if let Some(e) = &o.error {
        anyhow::bail!("probe failed: {e}");
    }
    Ok((
        o.ttft.context("no first token")?,
        o.e2e.context("no end")?,
        o.completion_tokens,
    ))
}

/// The mean gap between streamed tokens of one outcome, in µs.
fn step_us(o: &Outcome) -> anyhow::Result<f64> {
    let (ttft, e2e, tokens) = ok(o)?;
    anyhow::ensure!(tokens > 1, "a decode probe produced {tokens} tokens");
    Ok((e2e - ttft).as_secs_f64() * 1e6 / (tokens - 1) as f64)
}

/// Least squares `y = p0 + p1·x + p2·x²`.
fn fit_quadratic(points: &[(f64, f64)]) -> Option<[f64; 3]> {
    let mut m = [[0.0f64; 4]; 3];
    for &(x, y) in points {
        let row = [1.0, x, x * x];
        for i in 0..3 {
            for j in 0..3 {
                m[i][j] += row[i] * row[j];
            }
            m[i][3] += row[i] * y;
        }
    }
    // Gaussian elimination with partial pivoting.
    for c in 0..3 {
        let p = (c..3).max_by(|&a, &b| m[a][c].abs().total_cmp(&m[b][c].abs()))?;
        m.swap(c, p);
        if m[c][c].abs() < 1e-12 {
            return None;
        }
        let pivot = m[c];
        for (r, row) in m.iter_mut().enumerate() {
            if r != c {
                let f = row[c] / pivot[c];
                for (x, p) in row.iter_mut().zip(pivot).skip(c) {
                    *x -= f * p;
                }
            }
        }
    }
    Some([m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]])
}

/// The engine's block size and GPU blocks from `vllm:cache_config_info`.
async fn cache_config(engine: SocketAddr) -> anyhow::Result<(u32, u64)> {
    let (status, page) = kvepp_test_support::client::fetch(engine, "/metrics")
        .await
        .map_err(anyhow::Error::msg)?;
    anyhow::ensure!(status == 200, "{engine}/metrics: status {status}");
    let line = page
        .lines()
        .find(|l| l.starts_with("vllm:cache_config_info{"))
        .context("no vllm:cache_config_info on the engine's metrics page")?;
    let label = |k: &str| {
        let start = line.find(&format!("{k}=\""))? + k.len() + 2;
        let end = start + line[start..].find('"')?;
        line[start..end].parse::<u64>().ok()
    };
    Ok((
        label("block_size").context("no block_size")? as u32,
        label("num_gpu_blocks").context("no num_gpu_blocks")?,
    ))
}

/// Measures the engine.
pub async fn measure(a: &CalibrateArgs) -> anyhow::Result<(SimParams, Measured)> {
    let (block_size, blocks) = cache_config(a.engine).await?;
    let mut m = Measured::default();
    for &n in &a.prefill_lengths {
        let mut t = Vec::new();
        for _ in 0..a.repeats {
            let o = completion(a.engine, body(&a.model, &fresh_ids(n), 1), None).await;
            t.push(ok(&o)?.0.as_secs_f64() * 1e6);
        }
        m.prefill_ttft_us.push((n, median(t)));
    }
    let longest = a.prefill_lengths.iter().copied().max().unwrap_or(1024);
    let cached = fresh_ids(longest);
    ok(&completion(a.engine, body(&a.model, &cached, 1), None).await)?;
    let mut t = Vec::new();
    for _ in 0..a.repeats {
        let o = completion(a.engine, body(&a.model, &cached, 1), None).await;
        t.push(ok(&o)?.0.as_secs_f64() * 1e6);
    }
    m.cached_ttft_us = median(t);
    let decode = |ctx: u32| {
        completion(
            a.engine,
            body(&a.model, &fresh_ids(ctx), a.decode_tokens),
            None,
        )
    };
    let mut s1 = Vec::new();
    let mut sl = Vec::new();
    let mut sb = Vec::new();
    for _ in 0..a.repeats {
        s1.push(step_us(&decode(32).await)?);
        sl.push(step_us(&decode(a.long_context).await)?);
        let batch = futures::future::join_all((0..a.batch).map(|_| decode(32))).await;
        let steps: anyhow::Result<Vec<f64>> = batch.iter().map(step_us).collect();
        sb.push(median(steps?));
    }
    m.decode_step_batch1_us = median(s1);
    m.decode_step_long_us = median(sl);
    m.decode_step_batch_us = median(sb);

    let points: Vec<(f64, f64)> = m
        .prefill_ttft_us
        .iter()
        .map(|&(n, t)| (f64::from(n), t))
        .collect();
    let [_, per_token, quad] =
        fit_quadratic(&points).context("prefill lengths must be three or more distinct values")?;
    let per_seq =
        ((m.decode_step_batch_us - m.decode_step_batch1_us) / (a.batch as f64 - 1.0)).max(0.0);
    let per_kctx = ((m.decode_step_long_us - m.decode_step_batch1_us)
        / (f64::from(a.long_context.saturating_sub(32)) / 1000.0))
        .max(0.0);
    let step = (m.decode_step_batch1_us - per_seq).max(0.0);
    let params = SimParams {
        model: a.model.clone(),
        block_size,
        total_kv_blocks: blocks,
        max_num_seqs: a.max_num_seqs,
        max_num_batched_tokens: a.max_num_batched_tokens,
        step_overhead_us: step,
        prefill_us_per_token: per_token.max(0.0),
        prefill_us_per_token_per_kctx: (2000.0 * quad).max(0.0),
        decode_us_per_seq: per_seq,
        decode_us_per_kctx: per_kctx,
        ..SimParams::default()
    };
    Ok((params, m))
}

pub async fn run(a: &CalibrateArgs) -> anyhow::Result<()> {
    let (params, measured) = measure(a).await?;
    let text = format!(
        "# Calibrated by `kvepp-sim calibrate --engine {}` against the engine serving {:?}.\n# Measured (µs): {}\n{}",
        a.engine,
        a.model,
        serde_json::to_string(&measured)?,
        serde_yaml::to_string(&params)?
    );
    if a.out.as_os_str() == "-" {
        print!("{text}");
    } else {
        std::fs::write(&a.out, text).with_context(|| format!("write {}", a.out.display()))?;
        eprintln!("calibrate: parameters written to {}", a.out.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quadratic_fit_recovers_its_coefficients() {
        let pts: Vec<(f64, f64)> = [100.0, 500.0, 1000.0, 1500.0]
            .iter()
            .map(|&x| (x, 7000.0 + 40.0 * x + 0.002 * x * x))
            .collect();
        let [a, b, c] = fit_quadratic(&pts).unwrap();
        assert!((a - 7000.0).abs() < 1e-3, "{a}");
        assert!((b - 40.0).abs() < 1e-6, "{b}");
        assert!((c - 0.002).abs() < 1e-9, "{c}");
        assert!(fit_quadratic(&[(1.0, 1.0), (1.0, 2.0)]).is_none());
    }

    #[test]
    fn the_median_is_the_middle_value() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert!(median(Vec::new()).is_nan());
    }
}
