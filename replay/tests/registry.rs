//! The registry is the one list of policies: everything that names them is
//! checked against it (known-answer tests, method docs, README, SEMANTICS),
//! and the workspace's modules import each other without circles.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use kvreplay_replay::policies::{Build, REGISTRY};
use kvreplay_replay::PolicySpec;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_policy_has_a_known_answer_test_and_a_method_page() {
    let mut tests = String::new();
    let mut files = Vec::new();
    rust_files(&root().join("replay/tests"), &mut files);
    for f in files {
        tests += &read(&f);
    }
    for p in REGISTRY {
        let f = format!("fn {}()", p.test);
        let at = tests.find(&f).unwrap_or_else(|| {
            panic!(
                "policy {}: its known-answer test `{}` is missing under replay/tests/",
                p.name, p.test
            )
        });
        assert!(
            tests[..at].trim_end().ends_with("#[test]"),
            "{}: `{}` is not a #[test]",
            p.name,
            p.test
        );
        let page = root().join(format!("docs/methods/{}.md", p.name));
        assert!(
            page.exists(),
            "policy {}: {} is missing",
            p.name,
            page.display()
        );
        let src = [
            format!("replay/src/policies/{}.rs", p.name),
            format!("replay/src/policies/{}/mod.rs", p.name),
        ]
        .into_iter()
        .map(|f| root().join(f))
        .find(|f| f.exists())
        .unwrap_or_else(|| panic!("policy {}: no source file", p.name));
        assert!(
            read(&src).contains(&format!("docs/methods/{}.md", p.name)),
            "{}: cites no docs/methods/{}.md",
            src.display(),
            p.name
        );
        // every registered name builds with its defaults
        PolicySpec::parse(p.name).unwrap().build().unwrap();
    }
}

#[test]
fn readme_and_semantics_list_what_the_registry_says() {
    let readme = read(&root().join("README.md"));
    for p in REGISTRY {
        assert!(
            readme.contains(&format!("`{}`", p.name)),
            "README does not mention `{}`",
            p.name
        );
    }
    // SEMANTICS.md's list of policies that hold a fixed capacity during decode
    let sem = read(&root().join("replay/SEMANTICS.md"));
    let start = sem
        .find("- Decode-time policies (")
        .expect("SEMANTICS lists the decode-time policies");
    let list = &sem[start..start + sem[start..].find(')').unwrap()];
    let named: BTreeSet<&str> = list
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|n| !n.contains(':'))
        .collect();
    let holds: BTreeSet<&str> = REGISTRY
        .iter()
        .filter(|p| p.caps.holds_capacity)
        .map(|p| p.name)
        .collect();
    assert_eq!(
        named, holds,
        "SEMANTICS.md's decode-time list against the registry's capabilities"
    );
    // scorer wrappers and wrappers are said to be so in the listing
    let listing = kvreplay_replay::policies::listing();
    for p in REGISTRY {
        if let Build::ScorerWrapper { default_scorer, .. } = p.build {
            assert!(
                listing.contains(&format!("default {default_scorer}")),
                "{}",
                p.name
            );
            // one source of truth for the default scorer
            let param = p
                .params
                .iter()
                .find(|x| x.name == "scorer")
                .expect("a scorer parameter");
            assert_eq!(param.default, default_scorer, "{}", p.name);
        }
    }
}

/// Module files of one crate's `src`, by module path (`crate::a::b`).
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files
        .into_iter()
        .map(|f| {
            let rel = f.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> = rel
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect();
            if matches!(
                parts.last().map(|s| s.as_str()),
                Some("mod" | "lib" | "main")
            ) {
                parts.pop();
            }
            (
                std::iter::once("crate".to_string())
                    .chain(parts)
                    .collect::<Vec<_>>()
                    .join("::"),
                f,
            )
        })
        .collect()
}

/// The code of a file without its `#[cfg(test)] mod tests` and comments.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Module paths a file refers to: `crate::a::b...` and `super::...`,
/// including the names inside `use crate::{a, b::{c}}` groups.
fn references(module: &str, text: &str) -> Vec<String> {
    let parent = module.rsplit_once("::").map(|x| x.0).unwrap_or("crate");
    let mut out = Vec::new();
    for (prefix, base) in [("crate::", "crate"), ("super::", parent)] {
        let mut rest = text;
        while let Some(i) = rest.find(prefix) {
            let before = rest[..i].chars().last();
            rest = &rest[i + prefix.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            if let Some(group) = rest.strip_prefix('{') {
                // top-level names of a use group
                let (mut depth, mut end) = (0, group.len());
                for (k, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => {
                            end = k;
                            break;
                        }
                        '}' => depth -= 1,
                        _ => {}
                    }
                }
                let mut depth = 0;
                let mut item = String::new();
                for c in group[..end].chars().chain(std::iter::once(',')) {
                    match c {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            let path: String = item
                                .trim()
                                .chars()
                                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                                .collect();
                            out.push(format!("{base}::{}", path.trim_end_matches(':')));
                            item.clear();
                            continue;
                        }
                        _ => {}
                    }
                    item.push(c);
                }
            } else {
                let path: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                out.push(format!("{base}::{}", path.trim_end_matches(':')));
            }
        }
    }
    // relative paths to the module's own children (`mod x;` ... `x::item`)
    let children: Vec<&str> = text
        .lines()
        .filter_map(|l| {
            l.trim()
                .strip_prefix("pub ")
                .unwrap_or(l.trim())
                .strip_prefix("mod ")
        })
        .filter_map(|l| l.strip_suffix(';'))
        .collect();
    for c in children {
        let pat = format!("{c}::");
        let mut rest = text;
        while let Some(i) = rest.find(&pat) {
            let before = rest[..i].chars().last();
            rest = &rest[i + pat.len()..];
            if !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                out.push(format!("{module}::{c}"));
                break;
            }
        }
    }
    out
}

/// Every module of the workspace's crates and the modules it refers to
/// (resolved to the longest module prefix; a parent's references to its own
/// children are declarations, not imports, and are kept as edges too).
fn import_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mods = modules(src);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, f) in &mods {
        let text = code(&read(f));
        let edges = g.entry(m.clone()).or_default();
        for r in references(m, &text) {
            let mut target = r.as_str();
            while !mods.contains_key(target) {
                match target.rsplit_once("::") {
                    Some((a, _)) => target = a,
                    None => break,
                }
            }
            // a module's own items, and the crate root (re-exports), are no edges
            if target != m && target != "crate" && mods.contains_key(target) {
                edges.insert(target.to_string());
            }
        }
    }
    g
}

fn find_cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for m in g.get(n).into_iter().flatten() {
            match state.get(m.as_str()).copied().unwrap_or(0) {
                1 => {
                    let i = stack.iter().position(|x| x == m).unwrap();
                    let mut c = stack[i..].to_vec();
                    c.push(m.clone());
                    return Some(c);
                }
                0 => {
                    if let Some(c) = visit(m, g, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in g.keys() {
        if state.get(n.as_str()).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(n, g, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn no_module_of_the_workspace_imports_in_a_circle() {
    let crates = [
        "src",
        "traces/src",
        "kernels/src",
        "capture/src",
        "replay/src",
        "analysis/src",
        "validate/src",
    ];
    for c in crates {
        let g = import_graph(&root().join(c));
        assert!(
            g.len() > 1 || c == "traces/src" || c == "validate/src" || !g.is_empty(),
            "{c}: no modules found"
        );
        if let Some(cycle) = find_cycle(&g) {
            panic!(
                "{c}: modules import each other in a circle: {}",
                cycle.join(" -> ")
            );
        }
    }
}

#[test]
fn the_cycle_check_finds_a_planted_circle() {
    // a -> b -> a through `use crate::` and `super::` forms
    let a = references(
        "crate::a",
        "use crate::{b::{X, Y}, c};\nfn f() { super::d::g(); }",
    );
    assert_eq!(a, vec!["crate::b", "crate::c", "crate::d::g"]);
    // a parent's use of its child by a relative path is an edge too
    let a = references("crate::a", "pub mod k;\nfn f() { k::run(); }");
    assert_eq!(a, vec!["crate::a::k"]);
    let mut g = BTreeMap::new();
    g.insert(
        "crate::a".to_string(),
        BTreeSet::from(["crate::b".to_string()]),
    );
    g.insert(
        "crate::b".to_string(),
        BTreeSet::from(["crate::a".to_string()]),
    );
    assert!(find_cycle(&g).is_some());
    g.get_mut("crate::b").unwrap().clear();
    assert!(find_cycle(&g).is_none());
}

/// `kvreplay policies` groups policies by family under `== FAMILY ==`
/// headings (each policy under its own family's) and says of each whether it
/// is exact or approximated, and how.
#[test]
fn listing_groups_by_family_and_says_exact_or_approximated() {
    let listing = kvreplay_replay::policies::listing();
    let mut heading = String::new();
    let mut seen = Vec::new();
    let lines: Vec<&str> = listing.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if let Some(h) = line.strip_prefix("== ").and_then(|l| l.strip_suffix(" ==")) {
            heading = h.to_string();
            continue;
        }
        let Some(p) = REGISTRY
            .iter()
            .find(|p| line.split_whitespace().next() == Some(p.name) && !line.starts_with(' '))
        else {
            continue;
        };
        let want = match p.build {
            Build::Wrapper(_) => "wrappers".to_string(),
            _ => p.caps.family.name().to_string(),
        };
        assert!(
            heading.starts_with(&want),
            "{} listed under `{heading}`, not `{want}`",
            p.name
        );
        let flags = lines[i + 2];
        match p.caps.approximation {
            None => assert!(flags.ends_with("; exact"), "{}: {flags}", p.name),
            Some(how) => assert!(
                flags.ends_with(&format!("; approximated: {how}")),
                "{}: {flags}",
                p.name
            ),
        }
        seen.push(p.name);
    }
    assert_eq!(seen.len(), REGISTRY.len(), "listed: {seen:?}");
    assert!(REGISTRY.iter().any(|p| p.caps.approximation.is_some()));
}
