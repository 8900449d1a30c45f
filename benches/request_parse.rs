//! Body → model cost on the hot path, against the naive baseline measured in the same run
//! (a full `serde_json::Value` parse, which is what re-marshalling EPPs do), for 4 KiB and 400 KiB
//! bodies. Also the cost of joining a body that arrived in 16 KiB chunks.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;

fn body(size: usize) -> Vec<u8> {
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(size / 45 + 1);
    let mut b = format!("{{\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"max_tokens\":128,\"stream\":true,\"messages\":[{{\"role\":\"system\",\"content\":\"You are helpful.\"}},{{\"role\":\"user\",\"content\":\"{prompt}\"}}]}}");
    b.truncate(b.len());
    b.into_bytes()
}

fn parse(c: &mut Criterion) {
    let mut g = c.benchmark_group("body_to_model");
    for size in [4 << 10, 400 << 10] {
        let b = body(size);
        g.throughput(Throughput::Bytes(b.len() as u64));
        g.bench_with_input(BenchmarkId::new("kvepp_parse_body", size), &b, |bench, b| {
            bench.iter(|| kvepp::request::parse_body(black_box(b)).map(|p| p.model_span.len()))
        });
        g.bench_with_input(BenchmarkId::new("baseline_serde_value", size), &b, |bench, b| {
            bench.iter(|| serde_json::from_slice::<serde_json::Value>(black_box(b)).map(|v| v["model"].as_str().map(str::len)))
        });
        let chunks: Vec<Vec<u8>> = b.chunks(16 << 10).map(<[u8]>::to_vec).collect();
        g.bench_with_input(BenchmarkId::new("join_16k_chunks", size), &chunks, |bench, c| bench.iter(|| black_box(c).concat().len()));
    }
    g.finish();
}

criterion_group!(benches, parse);
criterion_main!(benches);
