//! No module imports one that imports it back, in any crate of the workspace: sources feed the
//! engine and the engine feeds the sinks, in one direction, and shared types live in leaf
//! modules (docs/ARCHITECTURE.md, "Module dependencies").
//!
//! The rule, over each crate's non-test code (its `mod tests` blocks and `#[cfg(test)]` module
//! files left out): module A depends on module B when A names a path under B, as `crate::B...`
//! or through `super::`, grouped imports (`crate::{b, c::D}`) included; the longest module
//! prefix of the path is the module named. A module naming its own ancestors is not counted:
//! a child may use its parent's items. Any other cycle fails, listing its modules and edges.
#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A crate's modules: module path (`a::b`, the root `""`) to its file.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if parts.first().is_some_and(|p| p == "bin") {
                continue;
            }
            if parts
                .last()
                .is_some_and(|p| matches!(p.as_str(), "lib" | "main" | "mod"))
            {
                parts.pop();
            }
            out.insert(parts.join("::"), path);
        }
    }
    out
}

/// The source without its trailing `mod tests` block and without `//` comments.
fn non_test_code(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let end = (0..lines.len())
        .find(|&i| {
            lines[i].trim() == "#[cfg(test)]"
                && lines
                    .get(i + 1)
                    .is_some_and(|l| l.trim_start().starts_with("mod tests"))
        })
        .unwrap_or(lines.len());
    lines[..end]
        .iter()
        .map(|l| l.find("//").map_or(*l, |i| &l[..i]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Module files declared `#[cfg(test)] mod x;` (test-only modules).
fn test_modules(mods: &BTreeMap<String, PathBuf>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (m, path) in mods {
        let text = std::fs::read_to_string(path).unwrap();
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        for w in lines.windows(2) {
            if w[0] != "#[cfg(test)]" {
                continue;
            }
            let decl = w[1]
                .trim_start_matches("pub(crate) ")
                .trim_start_matches("pub ");
            if let Some(name) = decl.strip_prefix("mod ").and_then(|d| d.strip_suffix(';')) {
                out.insert(if m.is_empty() {
                    name.to_string()
                } else {
                    format!("{m}::{name}")
                });
            }
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths of one use tree starting at `t[i..]` (`a::b`, `a::{b, c::d}`, `{a, b}`), and the
/// index after it.
fn use_tree(t: &[char], mut i: usize) -> (Vec<Vec<String>>, usize) {
    let skip_space = |mut i: usize| {
        while i < t.len() && (t[i].is_whitespace() || t[i] == ',') {
            i += 1;
        }
        i
    };
    if t.get(i) == Some(&'{') {
        let mut paths = Vec::new();
        i += 1;
        loop {
            i = skip_space(i);
            match t.get(i) {
                None => return (paths, i),
                Some('}') => return (paths, i + 1),
                _ => {
                    let (sub, next) = use_tree(t, i);
                    if next == i {
                        return (paths, i + 1);
                    }
                    paths.extend(sub);
                    i = next;
                }
            }
        }
    }
    let start = i;
    while i < t.len() && is_ident(t[i]) {
        i += 1;
    }
    if i == start {
        return (vec![vec![]], i);
    }
    let seg: String = t[start..i].iter().collect();
    if t.get(i) == Some(&':') && t.get(i + 1) == Some(&':') {
        let (sub, next) = use_tree(t, skip_space(i + 2));
        return (
            sub.into_iter()
                .map(|p| std::iter::once(seg.clone()).chain(p).collect())
                .collect(),
            next,
        );
    }
    (vec![vec![seg]], i)
}

/// Whether `t[i..]` starts with `word`.
fn at(t: &[char], i: usize, word: &str) -> bool {
    t.get(i..)
        .is_some_and(|rest| rest.iter().copied().take(word.len()).eq(word.chars()))
}

/// Every path the code names from `crate::` (ups: `None`) or from `super::` (ups: how many).
fn paths(code: &str) -> Vec<(Option<usize>, Vec<String>)> {
    let t: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < t.len() {
        let boundary = i == 0 || !is_ident(t[i - 1]);
        if boundary && at(&t, i, "crate::") {
            let (p, next) = use_tree(&t, i + 7);
            out.extend(p.into_iter().map(|p| (None, p)));
            i = next.max(i + 1);
        } else if boundary && at(&t, i, "super::") {
            let mut ups = 0;
            let mut j = i;
            while at(&t, j, "super::") {
                ups += 1;
                j += 7;
            }
            let (p, next) = use_tree(&t, j);
            out.extend(p.into_iter().map(|p| (Some(ups), p)));
            i = next.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}

/// The dependency edges between a crate's non-test modules.
fn edges(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mods = modules(src);
    let tests = test_modules(&mods);
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, path) in &mods {
        if tests.contains(m) {
            continue;
        }
        let here: Vec<String> = if m.is_empty() {
            vec![]
        } else {
            m.split("::").map(str::to_string).collect()
        };
        let code = non_test_code(&std::fs::read_to_string(path).unwrap());
        for (ups, p) in paths(&code) {
            let mut full: Vec<String> = match ups {
                None => vec![],
                Some(n) => here[..here.len().saturating_sub(n)].to_vec(),
            };
            full.extend(p);
            let target = (0..=full.len())
                .rev()
                .map(|k| full[..k].join("::"))
                .find(|c| mods.contains_key(c));
            let Some(target) = target else { continue };
            let ancestor =
                target.is_empty() || format!("{m}::").starts_with(&format!("{target}::"));
            if target == *m || ancestor || tests.contains(&target) {
                continue;
            }
            out.entry(m.clone()).or_default().insert(target);
        }
    }
    out
}

/// The strongly connected components of more than one module (Tarjan's algorithm).
fn cycles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    struct T<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        found: Vec<BTreeSet<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        if let Some(ws) = t.edges.get(v) {
            for w in ws {
                if !t.index.contains_key(w.as_str()) {
                    visit(t, w);
                    let low = t.low[v].min(t.low[w.as_str()]);
                    t.low.insert(v, low);
                } else if t.on.contains(w.as_str()) {
                    let low = t.low[v].min(t.index[w.as_str()]);
                    t.low.insert(v, low);
                }
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = BTreeSet::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.insert(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                t.found.push(comp);
            }
        }
    }
    let mut t = T {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: vec![],
        on: BTreeSet::new(),
        found: vec![],
    };
    for v in edges.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.found
}

/// Every crate's `src` in the workspace (the packages at the top and under `tests/`).
fn crates() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut out = Vec::new();
    for parent in [root.to_path_buf(), root.join("tests")] {
        for entry in std::fs::read_dir(&parent).unwrap() {
            let dir = entry.unwrap().path();
            if dir.join("Cargo.toml").is_file() && dir.join("src").is_dir() {
                out.push(dir.join("src"));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let crates = crates();
    assert!(
        crates.iter().any(|c| c.ends_with("agent/src")) && crates.len() >= 6,
        "the workspace's crates: {crates:?}"
    );
    let mut failures = Vec::new();
    for src in &crates {
        let edges = edges(src);
        for comp in cycles(&edges) {
            let inside: Vec<String> = comp
                .iter()
                .flat_map(|a| {
                    edges[a]
                        .iter()
                        .filter(|b| comp.contains(*b))
                        .map(move |b| format!("{a} -> {b}"))
                })
                .collect();
            failures.push(format!("{}: {comp:?}: {inside:?}", src.display()));
        }
    }
    assert!(
        failures.is_empty(),
        "module cycles:\n{}",
        failures.join("\n")
    );
}

/// The rule itself, on a crate written for it: a cycle through a grouped `crate::{..}` import
/// and one through `super::` are found; a child naming its parent, and test code, are not.
#[test]
fn the_rule_finds_cycles_through_groups_and_super_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    let write = |rel: &str, text: &str| {
        let p = src.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    write("lib.rs", "mod a;\nmod b;\nmod s;\n#[cfg(test)]\nmod t;\n");
    write(
        "a.rs",
        "use crate::{b::B, s};\n// crate::s::x::Nothing in a comment\n",
    );
    write("b.rs", "pub struct B;\nfn f() { crate::a::g(); }\n");
    write("s/mod.rs", "mod x;\nmod y;\nuse self::x::X;\n");
    write("s/x.rs", "use super::y::Y;\nuse super::super::a;\n");
    write(
        "s/y.rs",
        "use super::x::X;\n#[cfg(test)]\nmod tests {\n    use crate::b::B;\n}\n",
    );
    write("t.rs", "use crate::a;\nuse crate::b;\n");
    let e = edges(src);
    let found = cycles(&e);
    let as_sets: Vec<Vec<&str>> = found
        .iter()
        .map(|c| c.iter().map(String::as_str).collect())
        .collect();
    assert!(as_sets.contains(&vec!["a", "b"]), "{as_sets:?} {e:?}");
    assert!(as_sets.contains(&vec!["s::x", "s::y"]), "{as_sets:?} {e:?}");
    assert_eq!(found.len(), 2, "{as_sets:?}");
    assert!(!e["s::y"].contains("b"), "test code is left out: {e:?}");
    assert!(
        !e.contains_key("t"),
        "a test-only module is left out: {e:?}"
    );
    assert!(
        !e["s::x"].contains("s"),
        "a child naming its parent is fine: {e:?}"
    );
}
