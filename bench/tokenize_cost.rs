//! The tokenizer's own cost for one piece of text: `tokenize_cost DIR TEXT [--seconds S]`
//! tokenizes TEXT alone with the HuggingFace tokenizer in DIR (as kvepp loads it), 201 times or
//! for S seconds, and prints the median wall-clock µs of a call and the thread's CPU µs per call
//! (Linux: `/proc/thread-self/schedstat`; elsewhere wall time). bench/cpu_per_request.py compares
//! tokens mode's extra CPU per request with the CPU figure.

use std::time::{Duration, Instant};

/// This thread's CPU time so far, where the kernel tells it.
fn thread_cpu() -> Option<Duration> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = s.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
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
    let t = kvepp::request::tokenize::ModelTokenizer::load(std::path::Path::new(dir))?;
    let n = t.text_ids_whole(text)?.len();
    let until = seconds.map(|s| Instant::now() + Duration::from_secs_f64(s));
    let mut times = Vec::with_capacity(201);
    let (wall0, cpu0) = (Instant::now(), thread_cpu());
    while match until {
        Some(u) => Instant::now() < u || times.is_empty(),
        None => times.len() < 201,
    } {
        let start = Instant::now();
        t.text_ids_whole(text)?;
        times.push(start.elapsed());
    }
    let cpu = match (cpu0, thread_cpu()) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => wall0.elapsed(),
    };
    times.sort();
    println!(
        "{:.2} µs for {n} tokens (median wall); {:.2} µs CPU per call over {} calls",
        times[times.len() / 2].as_secs_f64() * 1e6,
        cpu.as_secs_f64() * 1e6 / times.len() as f64,
        times.len()
    );
    Ok(())
}
