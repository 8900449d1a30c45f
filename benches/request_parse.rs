//! Body → model cost on the hot path, against the naive baseline measured in the same run
//! (a full `serde_json::Value` parse, which is what re-marshalling EPPs do), for 4 KiB and 400 KiB
//! bodies. Also the cost of joining a body that arrived in 16 KiB chunks.
// Test code: a failed expectation is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

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
        g.bench_with_input(
            BenchmarkId::new("kvepp_parse_body", size),
            &b,
            |bench, b| {
                bench.iter(|| kvepp_request::parse_body(black_box(b)).map(|p| p.model_span.len()))
            },
        );
        g.bench_with_input(
            BenchmarkId::new("baseline_serde_value", size),
            &b,
            |bench, b| {
                bench.iter(|| {
                    serde_json::from_slice::<serde_json::Value>(black_box(b))
                        .map(|v| v["model"].as_str().map(str::len))
                })
            },
        );
        let chunks: Vec<Vec<u8>> = b.chunks(16 << 10).map(<[u8]>::to_vec).collect();
        g.bench_with_input(
            BenchmarkId::new("join_16k_chunks", size),
            &chunks,
            |bench, c| bench.iter(|| black_box(c).concat().len()),
        );
    }
    g.finish();
}

/// Prints kvepp's cost as a ratio of the baseline, both timed here in the same run.
fn ratios(_: &mut Criterion) {
    fn time(iters: u32, f: impl Fn() -> usize) -> f64 {
        let start = std::time::Instant::now();
        for _ in 0..iters {
            black_box(f());
        }
        start.elapsed().as_secs_f64() / f64::from(iters)
    }
    for size in [4 << 10, 400 << 10] {
        let b = body(size);
        let iters = if size < 100_000 { 20_000 } else { 300 };
        let ours = time(iters, || {
            kvepp_request::parse_body(black_box(&b)).map_or(0, |p| p.model_span.len())
        });
        let base = time(iters, || {
            serde_json::from_slice::<serde_json::Value>(black_box(&b))
                .map_or(0, |v| v["model"].as_str().map_or(0, str::len))
        });
        println!(
            "ratio body_to_model/{size}: kvepp {:.2} µs vs serde_json::Value {:.2} µs = {:.2}×",
            ours * 1e6,
            base * 1e6,
            ours / base
        );
    }
    // A completions body whose prompt is one ~400 KiB plain string (approximate mode's usual
    // body), and a chat body with dense escapes (its messages split): read by kvepp's JSON walk,
    // against serde's own scan of the same body (skipped unbuilt).
    for (name, b) in [
        ("completion_string", completion_body(400 << 10)),
        ("chat_escapes", chat_escapes_body(400 << 10)),
        ("tools_short_strings", tools_body(300)),
    ] {
        let ours = time(300, || {
            kvepp_request::parse_body(black_box(&b)).map_or(0, |p| p.model_span.len())
        });
        let skip = time(300, || {
            serde_json::from_slice::<serde::de::IgnoredAny>(black_box(&b)).map_or(0, |_| 1)
        });
        println!(
            "ratio {name}/{} bytes: kvepp {:.2} µs vs serde skipping it {:.2} µs = {:.2}×",
            b.len(),
            ours * 1e6,
            skip * 1e6,
            ours / skip
        );
    }
}

/// A chat body whose system message holds a document of about `size` bytes with an escaped
/// newline every few dozen bytes (how a document or code reaches a chat).
fn chat_escapes_body(size: usize) -> Vec<u8> {
    let doc = "kv cache routing prefill decode block 42,\\n".repeat(size / 44 + 1);
    format!(
        "{{\"model\":\"m\",\"messages\":[{{\"role\":\"system\",\"content\":\"{doc}\"}},{{\"role\":\"user\",\"content\":\"And about \\\"decode\\\"?\"}}]}}"
    )
    .into_bytes()
}

/// A chat body with `n` tool definitions: many short strings and small objects (an agent's
/// request), where a string rarely fills a step.
fn tools_body(n: usize) -> Vec<u8> {
    let tool = |i: usize| {
        format!(
            r#"{{"type":"function","function":{{"name":"tool_{i}","description":"Looks up item {i} in the catalog.","parameters":{{"type":"object","properties":{{"id":{{"type":"integer"}},"verbose":{{"type":"boolean","default":false}}}},"required":["id"]}}}}}}"#
        )
    };
    let tools: Vec<String> = (0..n).map(tool).collect();
    format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"Find item 7."}}],"tools":[{}],"tool_choice":"auto","temperature":0.2}}"#,
        tools.join(",")
    )
    .into_bytes()
}

/// A completions body with a plain `prompt` string of about `size` bytes.
fn completion_body(size: usize) -> Vec<u8> {
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(size / 45 + 1);
    format!("{{\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"max_tokens\":128,\"prompt\":\"{prompt}\"}}")
        .into_bytes()
}

/// The `i`-th id of the benches' prompts (spread over a 128k vocabulary).
fn bench_id(i: u32) -> u32 {
    i.wrapping_mul(2_654_435_761) % 128_000
}

/// A completions body whose prompt is `n` token ids (the `token_ids` prefix mode).
fn token_ids_body(n: u32) -> Vec<u8> {
    ids_body((0..n).map(bench_id))
}

fn ids_body(ids: impl Iterator<Item = u32>) -> Vec<u8> {
    let ids: Vec<String> = ids.map(|i| i.to_string()).collect();
    format!(
        "{{\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"max_tokens\":128,\"prompt\":[{}]}}",
        ids.join(",")
    )
    .into_bytes()
}

/// The chunk cache of token-id prompts against reading every id, in the same run, call for call
/// (the median of each): 100k-id prompts never seen before (each starts with its own id), and
/// conversation turns (the same 99k ids, then 1,000 of their own).
fn token_id_chunk_ratios(_: &mut Criterion) {
    let ids = bench_id;
    let fresh: Vec<Vec<u8>> = (0..60)
        .map(|k| ids_body(std::iter::once(200_000 + k).chain((1..100_000).map(ids))))
        .collect();
    let turns: Vec<Vec<u8>> = (0..60)
        .map(|k| {
            ids_body(
                (0..99_000)
                    .map(ids)
                    .chain((0..1_000).map(|i| 300_000 + k * 1_000 + i)),
            )
        })
        .collect();
    let chunks = kvepp_request::IdChunks::new(kvepp_request::ID_CHUNK_CACHE_IDS);
    // The conversation's earlier turns: its start seen twice (then every chunk is remembered).
    for b in &turns[..2] {
        black_box(kvepp_request::parse_body_with(b, Some(&chunks)).is_ok());
    }
    let once = |f: &dyn Fn() -> bool| {
        let start = std::time::Instant::now();
        assert!(black_box(f()));
        start.elapsed().as_secs_f64()
    };
    for (name, bodies) in [("fresh", &fresh[..]), ("next turn", &turns[2..])] {
        let (mut plain, mut cached) = (Vec::new(), Vec::new());
        for b in bodies.iter() {
            plain.push(once(&|| kvepp_request::parse_body(black_box(b)).is_ok()));
            cached.push(once(&|| {
                kvepp_request::parse_body_with(black_box(b), Some(&chunks)).is_ok()
            }));
        }
        let (p, c) = (median(plain) * 1e6, median(cached) * 1e6);
        println!(
            "ratio token_id_chunks/{name}: with the chunk cache {c:.0} µs, reading every id {p:.0} µs = {:.2}×",
            c / p
        );
    }
}

/// The median of timings (a VM's neighbours slow some calls down, not the median).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// parse_body, then the prompt's token ids: how many there are.
fn ids_read(body: &[u8]) -> usize {
    let parsed = kvepp_request::parse_body(black_box(body)).expect("valid body");
    match kvepp::routing::prompt_input(parsed.messages, parsed.prompt) {
        kvepp::routing::PromptInput::TokenIds(ids) => ids.len(),
        _ => 0,
    }
}

/// A token-id prompt of 100k ids: parsing the body and reading the ids (what kvepp does per
/// request in `token_ids` mode), against a full `serde_json::Value` parse.
fn token_id_ratios(_: &mut Criterion) {
    let b = token_ids_body(100_000);
    let iters = 100;
    // The median of single calls: a VM's neighbours slow some calls down, not the median.
    let time = |f: &dyn Fn() -> usize| {
        let each: Vec<f64> = (0..iters)
            .map(|_| {
                let start = std::time::Instant::now();
                black_box(f());
                start.elapsed().as_secs_f64()
            })
            .collect();
        median(each)
    };
    let parse =
        time(&|| kvepp_request::parse_body(black_box(&b)).map_or(0, |p| p.model_span.len()));
    let ids = time(&|| ids_read(&b));
    let base = time(&|| {
        serde_json::from_slice::<serde_json::Value>(black_box(&b))
            .map_or(0, |v| v["prompt"].as_array().map_or(0, Vec::len))
    });
    println!(
        "ratio token_ids/{} bytes: parse_body {:.0} µs, parse_body + ids {:.0} µs, serde_json::Value {:.0} µs = {:.2}×",
        b.len(),
        parse * 1e6,
        ids * 1e6,
        base * 1e6,
        ids / base
    );
    // The same ids as Python's `json.dumps` writes them (`, ` between ids).
    let spaced = String::from_utf8(b.clone())
        .expect("ascii")
        .replace(',', ", ")
        .into_bytes();
    let spaced_ids = time(&|| ids_read(&spaced));
    println!(
        "ratio token_ids/`, ` between ids: parse_body + ids {:.0} µs against {:.0} µs with `,` = {:.2}×",
        spaced_ids * 1e6,
        ids * 1e6,
        spaced_ids / ids
    );
    // The same ids after one of ten digits (a request counter, say): the reader reads such an id
    // byte by byte in its turn and goes on as before.
    let long = ids_body(std::iter::once(4_000_000_000).chain((1..100_000).map(bench_id)));
    let long_first =
        time(&|| kvepp_request::parse_body(black_box(&long)).map_or(0, |p| p.model_span.len()));
    println!(
        "ratio token_ids/a first id of ten digits: parse_body {:.0} µs against {:.0} µs = {:.2}×",
        long_first * 1e6,
        parse * 1e6,
        long_first / parse
    );
}

criterion_group!(
    benches,
    parse,
    ratios,
    token_id_ratios,
    token_id_chunk_ratios
);
criterion_main!(benches);
