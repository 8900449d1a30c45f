//! The tokenizer's own cost for one piece of text: `tokenize_cost DIR TEXT [--seconds S]
//! [--evict-mib M] [--own | --completion]` tokenizes TEXT alone with the HuggingFace tokenizer in
//! DIR (as kvepp loads it), 201 times or for S seconds, and prints the median wall-clock µs of a
//! call and the thread's CPU µs per call (the thread's CPU clock). bench/cpu_per_request.py
//! compares tokens mode's extra CPU per request with the CPU figure. With `--own` the calls are
//! kvepp's own segment encoder instead (`ModelTokenizer::segment_ids`: its byte-level BPE where it
//! covers the tokenizer), for TEXT without added tokens. With `--completion` they are kvepp's
//! tokens-mode completions path (`ModelTokenizer::completion_ids` on TEXT as a JSON string), to
//! set against the library's whole encoding, which that path used before (special tokens aside).
//!
//! With `--evict-mib M`, M MiB are written (a byte per cache line) before every call, so the
//! tokenizer's tables are no longer in the CPU caches when it starts, as in a process that moves
//! large bodies between two calls. The CPU figure covers the calls alone (read around each).

use std::time::{Duration, Instant};

/// This thread's CPU time so far.
fn thread_cpu() -> Duration {
    Duration::from_nanos(kvepp_tokenizer::thread_cpu_nanos())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(dir), Some(text)) = (args.first(), args.get(1)) else {
        anyhow::bail!("usage: tokenize_cost DIR TEXT [--seconds S]");
    };
    let seconds: Option<f64> = match args.iter().position(|a| a == "--seconds") {
        Some(i) => Some(
            args.get(i + 1)
                .ok_or_else(|| anyhow::anyhow!("--seconds needs a value"))?
                .parse()?,
        ),
        None => None,
    };
    let evict_mib: usize = match args.iter().position(|a| a == "--evict-mib") {
        Some(i) => args
            .get(i + 1)
            .ok_or_else(|| anyhow::anyhow!("--evict-mib needs a value"))?
            .parse()?,
        None => 0,
    };
    let own = args.iter().any(|a| a == "--own");
    let completion = args.iter().any(|a| a == "--completion");
    let prompt = serde_json::to_string(text)?;
    let mut junk = vec![0u8; evict_mib << 20];
    let mut calls_cpu = Duration::ZERO;
    let t = kvepp_tokenizer::ModelTokenizer::load(std::path::Path::new(dir))?;
    let call = |text: &str| {
        if completion {
            t.completion_ids(&prompt)
        } else if own {
            t.segment_ids(text)
        } else {
            t.text_ids_whole(text)
        }
    };
    let n = call(text)?.len();
    let until = seconds.map(|s| Instant::now() + Duration::from_secs_f64(s));
    let mut times = Vec::with_capacity(201);
    while match until {
        Some(u) => Instant::now() < u || times.is_empty(),
        None => times.len() < 201,
    } {
        let round = times.len() as u8;
        for b in junk.iter_mut().step_by(64) {
            *b = b.wrapping_add(round);
        }
        std::hint::black_box(&junk);
        let (start, cpu_start) = (Instant::now(), thread_cpu());
        call(text)?;
        let wall = start.elapsed();
        times.push(wall);
        calls_cpu += thread_cpu().saturating_sub(cpu_start);
    }
    times.sort();
    println!(
        "{:.2} µs for {n} tokens (median wall); {:.2} µs CPU per call over {} calls",
        times[times.len() / 2].as_secs_f64() * 1e6,
        calls_cpu.as_secs_f64() * 1e6 / times.len() as f64,
        times.len()
    );
    Ok(())
}
