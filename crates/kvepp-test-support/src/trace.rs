//! The workload traces the benchmarks replay: the Mooncake conversation trace the repository
//! carries (`bench/data/`, with its source, licence and checksums) and any trace file a user
//! names, gzipped or not.

use std::path::{Path, PathBuf};

/// The Mooncake conversation trace, relative to the repository root (where the benchmark
/// scripts run).
pub const MOONCAKE_TRACE: &str = "bench/data/conversation_trace.jsonl.gz";

/// [`MOONCAKE_TRACE`] in this checkout, found from any package.
pub fn mooncake_trace() -> PathBuf {
    crate::harness::repo_root().join(MOONCAKE_TRACE)
}

/// A trace file's text (JSON lines), gunzipped when its name ends in `.gz`.
pub fn read_text(path: &Path) -> std::io::Result<String> {
    let file = std::fs::File::open(path)?;
    let mut text = String::new();
    if path.extension().is_some_and(|e| e == "gz") {
        std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(file), &mut text)?;
    } else {
        std::io::Read::read_to_string(&mut std::io::BufReader::new(file), &mut text)?;
    }
    Ok(text)
}
