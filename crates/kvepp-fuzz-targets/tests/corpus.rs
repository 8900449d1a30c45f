//! The fuzz corpora replayed on stable: every input saved under `crates/kvepp-fuzz/corpus/<target>`
//! (what the fuzzer kept for coverage) and `crates/kvepp-fuzz/regressions/<target>` (every crash it
//! found, kept once fixed) goes through the same target function cargo-fuzz runs, with the same
//! checks. `scripts/fuzz.sh` grows the corpora.
// Test code: a failed expectation is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvepp_fuzz_targets as targets;
use std::path::Path;

fn inputs(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, Vec<u8>)> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| (p.display().to_string(), std::fs::read(&p).unwrap()))
        .collect();
    out.sort();
    out
}

#[test]
fn every_saved_fuzz_input_passes_its_target() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../kvepp-fuzz");
    for (name, target) in targets::ALL {
        let corpus = inputs(&root.join("corpus").join(name));
        assert!(
            corpus.len() >= 3,
            "{name}: the corpus has {} inputs; run scripts/fuzz.sh",
            corpus.len()
        );
        for (file, data) in corpus
            .iter()
            .chain(&inputs(&root.join("regressions").join(name)))
        {
            let r = std::panic::catch_unwind(|| target(data));
            assert!(r.is_ok(), "{name}: {file} fails its target");
        }
    }
}
