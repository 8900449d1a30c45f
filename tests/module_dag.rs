//! The modules form a DAG: no cycle between the top-level modules of `src/`, nor between those of
//! each library crate (`crates/kvepp-core/src`, `crates/kvepp-request/src`,
//! `crates/kvepp-tokenizer/src`, `crates/kvepp-extproc/src`). An edge is any `crate::<module>` path (or, in the
//! core, a `super::<module>` path from a module's own file) outside test code; documentation
//! comments do not count.
// Test code: a failed expectation is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("source directory") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (None for the crate root and binaries).
fn top_module(root: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(root).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.trim_end_matches(".rs");
    (!matches!(name, "lib" | "main" | "bin")).then(|| name.to_owned())
}

/// The code of a file without comments and without its test modules.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap_or(text);
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn edges(root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(root, &mut files);
    let modules: BTreeSet<String> = files.iter().filter_map(|f| top_module(root, f)).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
        // Unit tests in files of their own: `<module>/tests.rs` and `<module>/tests/<topic>.rs`.
        let in_tests = f
            .strip_prefix(root)
            .is_ok_and(|rel| rel.components().any(|c| c.as_os_str() == "tests"));
        if name.ends_with("tests.rs") || in_tests {
            continue;
        }
        let Some(from) = top_module(root, f) else {
            continue;
        };
        let text = code(&std::fs::read_to_string(f).expect("source file"));
        for m in &modules {
            if m == &from {
                continue;
            }
            let top_file = f.parent() == Some(root);
            if text.contains(&format!("crate::{m}::"))
                || text.contains(&format!("crate::{m};"))
                || text.contains(&format!("crate::{m}}}"))
                || (top_file && text.contains(&format!("super::{m}::")))
            {
                graph.entry(from.clone()).or_default().insert(m.clone());
            }
        }
    }
    graph
}

/// A cycle through `graph`, when there is one.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == n) {
            let mut c = path[i..].to_vec();
            c.push(n.to_owned());
            return Some(c);
        }
        if done.contains(n) {
            return None;
        }
        path.push(n.to_owned());
        for next in graph.get(n).into_iter().flatten() {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(n.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_server_and_the_core_have_no_module_cycle() {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    // Each with the fewest modules that have edges, so a checker that finds none fails.
    for (dir, least) in [
        ("src", 5),
        ("crates/kvepp-core/src", 5),
        ("crates/kvepp-request/src", 2),
        ("crates/kvepp-tokenizer/src", 1),
        ("crates/kvepp-extproc/src", 1),
    ] {
        let graph = edges(&here.join(dir));
        assert!(graph.len() >= least, "{dir}: edges found: {graph:?}");
        assert_eq!(cycle(&graph), None, "{dir}: module cycle");
    }
}

#[test]
fn the_checker_finds_a_cycle() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.entry("a".into()).or_default().insert("b".into());
    g.entry("b".into()).or_default().insert("c".into());
    assert_eq!(cycle(&g), None);
    g.entry("c".into()).or_default().insert("a".into());
    assert_eq!(
        cycle(&g),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
}
