//! The modules form a DAG at every level of each crate (`src/`, and the crates' `src/` folders):
//! no cycle between the top-level modules, nor between the files and folders of any one module
//! (`kv/ordered.rs`, `kv/roster.rs`, …). An edge is a `crate::…`, `super::…` or `self::…` path in
//! non-test code, resolved to the sibling module it names; comments do not count.
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

/// A file's module path below the crate root: `kv/ordered.rs` → `[kv, ordered]`, `kv.rs` and
/// `kv/mod.rs` → `[kv]`, the crate root `[]`; None for binaries and test files.
fn module_path(root: &Path, file: &Path) -> Option<Vec<String>> {
    let rel = file.strip_prefix(root).ok()?;
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let last = parts.pop()?;
    if parts.iter().any(|p| p == "bin" || p == "tests") || last.ends_with("tests.rs") {
        return None;
    }
    let stem = last.trim_end_matches(".rs");
    match (parts.is_empty(), stem) {
        // The crate root, or a folder's own file (`kv/mod.rs` is `kv`).
        (true, "lib" | "main") | (_, "mod") => {}
        _ => parts.push(stem.to_owned()),
    }
    Some(parts)
}

/// Module paths written in `code` from a file of module `here` (`crate::a::b`, `super::c`,
/// `self::d`), made absolute; each is the longest run of path segments.
fn paths_named(code: &str, here: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < bytes.len() {
        let starts = (i == 0 || !ident(bytes[i - 1]) && bytes[i - 1] != b':')
            && ["crate::", "super::", "self::"]
                .iter()
                .any(|p| bytes[i..].starts_with(p.as_bytes()));
        if !starts {
            i += 1;
            continue;
        }
        let mut segs = Vec::new();
        let mut j = i;
        loop {
            let k = j + bytes[j..].iter().take_while(|c| ident(**c)).count();
            if k == j {
                break;
            }
            segs.push(&code[j..k]);
            if bytes[k..].starts_with(b"::") {
                j = k + 2;
            } else {
                j = k;
                break;
            }
        }
        i = j.max(i + 1);
        let mut abs: Vec<String> = match segs.first() {
            Some(&"crate") => Vec::new(),
            Some(&"self") => here.to_vec(),
            _ => {
                let ups = segs.iter().take_while(|s| **s == "super").count();
                if ups > here.len() {
                    continue;
                }
                here[..here.len() - ups].to_vec()
            }
        };
        let rest = segs
            .iter()
            .skip_while(|s| matches!(**s, "crate" | "self" | "super"));
        abs.extend(rest.map(|s| s.to_string()));
        out.push(abs);
    }
    out
}

/// Edges between sibling modules at every level of the crate at `root`: `a::b → a::c` when
/// `a/b.rs` (or anything below `a::b`) names `a::c` or something inside it.
fn sibling_edges(root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(root, &mut files);
    let named: Vec<(Vec<String>, &PathBuf)> = files
        .iter()
        .filter_map(|f| Some((module_path(root, f)?, f)))
        .collect();
    let modules: BTreeSet<Vec<String>> = named
        .iter()
        .flat_map(|(p, _)| (1..=p.len()).map(move |n| p[..n].to_vec()))
        .collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (here, f) in &named {
        let text = code(&std::fs::read_to_string(f).expect("source file"));
        for target in paths_named(&text, here) {
            let common = here.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if common >= here.len() || common >= target.len() {
                continue;
            }
            let sibling = target[..=common].to_vec();
            if modules.contains(&sibling) {
                graph
                    .entry(here[..=common].join("::"))
                    .or_default()
                    .insert(sibling.join("::"));
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

/// Every circle of sibling modules, at any level, in each crate.
#[test]
fn no_module_cycle_at_any_level() {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut circles = Vec::new();
    // Each with the fewest top-level modules that have edges, so a checker that finds none fails.
    for (dir, least) in [
        ("src", 5),
        ("crates/kvepp-core/src", 5),
        ("crates/kvepp-request/src", 2),
        ("crates/kvepp-tokenizer/src", 1),
        ("crates/kvepp-extproc-wire/src", 1),
        ("crates/kvepp-sim/src", 0),
        ("crates/kvepp-bench/src", 0),
        ("crates/kvepp-test-support/src", 0),
    ] {
        let graph = sibling_edges(&here.join(dir));
        let top = graph.keys().filter(|k| !k.contains("::")).count();
        assert!(top >= least, "{dir}: edges found: {graph:?}");
        // A checker that finds no edge between files of one folder would pass anything.
        if dir == "crates/kvepp-core/src" {
            assert!(
                graph.keys().any(|k| k.contains("::")),
                "{dir}: no edge below the top level found: {graph:?}"
            );
        }
        // Every circle, each reported once: an edge of each found is set aside before the next.
        let mut graph = graph;
        while let Some(c) = cycle(&graph) {
            circles.push(format!("{dir}: {}", c.join(" → ")));
            if let Some(next) = graph.get_mut(&c[0]) {
                next.remove(&c[1]);
            }
        }
    }
    assert!(circles.is_empty(), "module cycles:\n{}", circles.join("\n"));
}

#[test]
fn the_sibling_checker_resolves_paths() {
    let here: Vec<String> = vec!["kv".into(), "ordered".into()];
    let named = paths_named(
        "use super::roster::X; use crate::hash::memo; let a = self::inner::f(); use super::*;",
        &here,
    );
    assert_eq!(
        named,
        [
            vec!["kv", "roster", "X"],
            vec!["hash", "memo"],
            vec!["kv", "ordered", "inner", "f"],
            vec!["kv"],
        ]
        .map(|v| v.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    );
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
