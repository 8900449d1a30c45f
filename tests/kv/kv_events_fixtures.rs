//! Byte-exact vLLM KV-event payloads (generated with msgspec by
//! tests/fixtures/kv_events/generate.py) decode to exactly what the generator says, and every
//! malformed one is rejected whole.

use std::path::PathBuf;

use kvepp::kv_events::{decode_batch, KvEvent, Tier};
use serde_json::{json, Value};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kv_events")
}

fn tier(t: Tier) -> &'static str {
    match t {
        Tier::Device => "device",
        Tier::Host => "host",
        Tier::Disk => "disk",
    }
}

fn hashes(h: &[kvepp::kv_events::EngineBlockHash]) -> Value {
    h.iter().map(|h| Value::String(h.0.to_string())).collect()
}

/// The decoded event in the generator's normalised JSON shape.
fn normalise(ev: &KvEvent) -> Value {
    match ev {
        KvEvent::Stored {
            block_hashes,
            parent,
            token_ids,
            block_size,
            lora_name,
            tier: t,
        } => json!({
            "type": "stored",
            "block_hashes": hashes(block_hashes),
            "parent": parent.map(|p| p.0.to_string()),
            "token_ids": token_ids,
            "block_size": block_size,
            "lora_name": lora_name,
            "tier": tier(*t),
        }),
        KvEvent::Removed {
            block_hashes,
            tier: t,
        } => json!({"type": "removed", "block_hashes": hashes(block_hashes), "tier": tier(*t)}),
        KvEvent::AllCleared => json!({"type": "cleared"}),
    }
}

#[test]
fn every_fixture_decodes_as_generated() {
    let expected: serde_json::Map<String, Value> =
        serde_json::from_slice(&std::fs::read(dir().join("expected.json")).expect("expected.json"))
            .expect("json");
    assert!(expected.len() >= 18, "fixtures missing: {}", expected.len());
    let (mut accepted, mut rejected) = (0, 0);
    for (name, want) in &expected {
        let payload = std::fs::read(dir().join(format!("{name}.msgpack")))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let got = decode_batch(&payload);
        if want["reject"] == true {
            assert!(got.is_err(), "{name} must be rejected, got {got:?}");
            rejected += 1;
            continue;
        }
        let batch = got.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(batch.ts, want["ts"].as_f64().unwrap(), "{name} ts");
        assert_eq!(
            batch.data_parallel_rank.map(u64::from),
            want["data_parallel_rank"].as_u64(),
            "{name} rank"
        );
        assert_eq!(
            batch.skipped_events as u64,
            want["skipped"].as_u64().unwrap(),
            "{name} skipped"
        );
        let events: Vec<Value> = batch.events.iter().map(normalise).collect();
        assert_eq!(Value::Array(events), want["events"], "{name} events");
        accepted += 1;
    }
    assert!(
        accepted >= 9 && rejected >= 9,
        "{accepted} accepted, {rejected} rejected"
    );
}

/// Garbage never panics: every fixture with random bytes flipped, cut or appended decodes to Ok or
/// Err, nothing else (fixed seed, so a failure reproduces).
#[test]
fn mutated_payloads_never_panic() {
    let mut rng = fastrand::Rng::with_seed(0x006b_7665_7070);
    let mut decoded = 0;
    for entry in std::fs::read_dir(dir()).expect("fixtures") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "msgpack") {
            continue;
        }
        let original = std::fs::read(&path).expect("read");
        for _ in 0..2_000 {
            let mut p = original.clone();
            match rng.u8(..3) {
                0 if !p.is_empty() => {
                    let i = rng.usize(..p.len());
                    p[i] = rng.u8(..);
                }
                1 if !p.is_empty() => p.truncate(rng.usize(..p.len())),
                _ => p.extend((0..rng.usize(1..8)).map(|_| rng.u8(..))),
            }
            if decode_batch(&p).is_ok() {
                decoded += 1;
            }
        }
    }
    // Some mutations stay valid (e.g. a changed token id), most do not; neither panics.
    assert!(
        decoded > 0,
        "no mutation decoded: the mutations are not exercising the decoder"
    );
}
