//! docs/architecture.md stays true: its table says which tandem crates each crate depends on,
//! and every crate's `Cargo.toml` must say the same (normal `[dependencies]`; test-only ones are
//! free). A new crate needs a row.
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// crate name -> the tandem crates its row allows, from the doc's table.
fn documented() -> BTreeMap<String, BTreeSet<String>> {
    let doc = std::fs::read_to_string(repo().join("docs/architecture.md")).unwrap();
    let mut rows = BTreeMap::new();
    for line in doc.lines().filter(|l| l.starts_with("| `tandem")) {
        let cells: Vec<&str> = line.trim_matches('|').split(" | ").map(str::trim).collect();
        assert_eq!(cells.len(), 4, "docs/architecture.md: a row needs 4 cells: {line}");
        let name = cells[0].trim_matches('`').to_string();
        let allowed = cells[2]
            .split(',')
            .map(|c| c.trim().trim_matches('`').to_string())
            .filter(|c| c.starts_with("tandem"))
            .collect();
        assert!(rows.insert(name.clone(), allowed).is_none(), "two rows for {name}");
    }
    rows
}

/// Every crate of the workspace: its directory name and path.
fn crates() -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(repo().join("crates")).unwrap() {
        let dir = entry.unwrap().path();
        if dir.join("Cargo.toml").exists() {
            out.push((dir.file_name().unwrap().to_string_lossy().to_string(), dir));
        }
    }
    out
}

fn declared(krate: &Path) -> BTreeSet<String> {
    let manifest = std::fs::read_to_string(krate.join("Cargo.toml")).unwrap();
    let manifest: toml::Table = manifest.parse().unwrap();
    manifest
        .get("dependencies")
        .and_then(|d| d.as_table())
        .map(|d| d.keys().filter(|k| k.starts_with("tandem")).cloned().collect())
        .unwrap_or_default()
}

#[test]
fn every_crate_depends_on_what_the_architecture_page_says() {
    let rows = documented();
    let mut seen = BTreeSet::new();
    for (name, dir) in crates() {
        let Some(allowed) = rows.get(&name) else {
            panic!("crates/{name} has no row in docs/architecture.md");
        };
        let deps = declared(&dir);
        assert_eq!(
            &deps, allowed,
            "crates/{name}/Cargo.toml depends on {deps:?}; docs/architecture.md says {allowed:?}"
        );
        seen.insert(name);
    }
    let stale: Vec<_> = rows.keys().filter(|k| !seen.contains(*k)).collect();
    assert!(stale.is_empty(), "docs/architecture.md has rows for missing crates: {stale:?}");
}

/// A file's code: its lines up to the first `#[cfg(test)]` (its unit tests follow).
fn code_lines(text: &str) -> impl Iterator<Item = &str> {
    text.lines().take_while(|l| l.trim() != "#[cfg(test)]")
}

/// Every library crate reports through typed events and `tracing` (stderr only as
/// tandem-comm's diagnostics fallback); only the `tandem` binary, the benchmarks and the test
/// helpers print.
#[test]
fn no_library_crate_prints() {
    let mut found = Vec::new();
    let printing = ["tandem-cli", "tandem-bench", "tandem-testutil"];
    for (name, dir) in crates().into_iter().filter(|(n, _)| !printing.contains(&n.as_str())) {
        for (path, text) in tandem_testutil::files_with_text(&dir.join("src")) {
            for (i, line) in code_lines(&text).enumerate() {
                let code = line.split("//").next().unwrap_or("");
                if ["println!", "eprintln!", "print!", "eprint!", "dbg!"]
                    .iter()
                    .any(|m| code.contains(m))
                {
                    found.push(format!("{name}: {}:{}: {}", path.display(), i + 1, line.trim()));
                }
            }
        }
    }
    assert!(found.is_empty(), "library crates print:\n{}", found.join("\n"));
}

/// Small modules with one job: no source file over 800 lines of code (counted up to its unit
/// tests), except the hand-tuned kernels and the pickle reader, which are one algorithm each.
#[test]
fn no_source_file_is_over_800_lines() {
    const MOST: usize = 800;
    let exempt = |p: &Path| {
        let p = p.to_string_lossy();
        p.contains("/kernels/") || p.ends_with("pickle/read.rs")
    };
    let mut long = Vec::new();
    for (_, dir) in crates() {
        for (path, text) in tandem_testutil::files_with_text(&dir.join("src")) {
            let lines = code_lines(&text).count();
            if path.extension().is_some_and(|e| e == "rs") && lines > MOST && !exempt(&path) {
                long.push(format!("{} ({lines} lines)", path.display()));
            }
        }
    }
    assert!(long.is_empty(), "files over {MOST} lines of code:\n{}", long.join("\n"));
}

/// crate name -> its layer in the doc's drawing (0 at the top).
fn drawn_layers() -> BTreeMap<String, usize> {
    let doc = std::fs::read_to_string(repo().join("docs/architecture.md")).unwrap();
    let start = doc.find("```text\n").expect("docs/architecture.md: no drawing") + 8;
    let end = start + doc[start..].find("```").unwrap();
    let mut layers = BTreeMap::new();
    let rows = doc[start..end].lines().filter(|l| l.trim_start().starts_with("tandem"));
    for (layer, row) in rows.enumerate() {
        // Crate names are the words before the row's description (two or more spaces apart).
        for word in row.split_whitespace().filter(|w| w.starts_with("tandem")) {
            let name = word.trim_end_matches(|c: char| !c.is_alphanumeric()).to_string();
            assert!(layers.insert(name.clone(), layer).is_none(), "{name} drawn twice");
        }
    }
    layers
}

/// The layers are an order: every crate depends only on crates drawn below its own row.
#[test]
fn every_crate_depends_only_on_layers_drawn_below_it() {
    let layers = drawn_layers();
    for (name, dir) in crates() {
        let Some(&mine) = layers.get(&name) else {
            panic!("crates/{name} is not in docs/architecture.md's drawing");
        };
        for dep in declared(&dir) {
            let theirs = layers.get(&dep).copied();
            assert!(
                theirs.is_some_and(|l| l > mine),
                "crates/{name} (layer {mine} from the top) depends on {dep} (layer {theirs:?}): \
                 docs/architecture.md must draw it below"
            );
        }
    }
}

/// Each library's public modules: the namespaces a user names (`tandem::train::checkpoint::Saved`,
/// `tandem::optim::zero`). Every other module is private behind the crate root's curated
/// `pub use`, as candle's crates are, so a module can move without breaking a user. Making a
/// module public is a decision: it is added here.
const PUBLIC_MODULES: &[(&str, &[&str])] = &[
    ("tandem", &[]),
    ("tandem-bench", &[]),
    (
        "tandem-ckpt",
        &[
            "atomic",
            "dcp",
            "error",
            "keys",
            "npy",
            "pt",
            "safetensors",
            "training",
            "tree",
            "value",
        ],
    ),
    ("tandem-cli", &[]),
    ("tandem-comm", &["auth", "live", "nccl", "procfs", "slurm"]),
    (
        "tandem-cuda",
        &[
            "batch_norm",
            "cudnn",
            "memory",
            "optim",
            "prelu",
            "profile",
            "reduce",
            "rows",
            "timing",
            "upload",
        ],
    ),
    ("tandem-data", &["datasets", "eval", "face_align", "randperm", "recordio", "transforms"]),
    ("tandem-ddp", &["comm_hooks", "metrics", "powersgd"]),
    ("tandem-dist-nn", &[]),
    ("tandem-fsdp", &[]),
    ("tandem-dylib", &[]),
    ("tandem-launch", &[]),
    ("tandem-models", &[]),
    ("tandem-nn", &["convert", "functional", "kernels", "torch_init", "weights"]),
    ("tandem-onnx", &["error", "graph", "models", "proto"]),
    ("tandem-optim", &["amp", "lr_scheduler", "zero"]),
    ("tandem-partial-fc", &[]),
    // (`face`, the face recipe's home, is re-exported from the private `recipes`.)
    ("tandem-recipes", &["face_eval", "options"]),
    (
        "tandem-testutil",
        &["child", "etcd", "harness", "netns", "procs", "row_fixture", "tmpfs", "world"],
    ),
    ("tandem-checkpoint", &[]),
    ("tandem-state", &["fault", "live", "state"]),
    // (`checkpoint` is the tandem-checkpoint crate, `schedule` tandem-optim's and `fault`, `live`
    // and `state` tandem-state's, re-exported.)
    ("tandem-train", &["events", "metrics"]),
];

/// The `pub mod` names of a crate's root (`src/lib.rs`; a binary-only crate has none).
fn public_modules(krate: &Path) -> BTreeSet<String> {
    let Ok(root) = std::fs::read_to_string(krate.join("src/lib.rs")) else {
        return BTreeSet::new();
    };
    root.lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod "))
        .map(|rest| rest.trim_end_matches([';', '{', ' ']).to_string())
        .collect()
}

#[test]
fn every_public_module_is_a_chosen_namespace() {
    let chosen: BTreeMap<&str, BTreeSet<String>> = PUBLIC_MODULES
        .iter()
        .map(|(k, mods)| (*k, mods.iter().map(|m| m.to_string()).collect()))
        .collect();
    for (name, dir) in crates() {
        let Some(want) = chosen.get(name.as_str()) else {
            panic!("crates/{name} is not in PUBLIC_MODULES (tests/architecture.rs)");
        };
        let got = public_modules(&dir);
        assert_eq!(
            &got, want,
            "crates/{name}/src/lib.rs makes {got:?} public; the chosen namespaces are {want:?} \
             (re-export an item at the root instead, or add the namespace here)"
        );
    }
}

/// A crate's modules (by path, `a::b`; the root is ``) and the modules each one names through
/// `crate::` or `super::` paths in its code, parents and children left out (a module declares
/// its children and they may use its private items).
fn module_imports(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let module_of = |path: &Path| {
        let rel = path.strip_prefix(src).unwrap().with_extension("");
        let mut parts: Vec<String> =
            rel.components().map(|c| c.as_os_str().to_string_lossy().to_string()).collect();
        if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
            parts.pop();
        }
        parts.join("::")
    };
    let files: Vec<(String, String)> = tandem_testutil::files_with_text(src)
        .into_iter()
        .filter(|(p, _)| p.extension().is_some_and(|e| e == "rs"))
        .map(|(p, text)| (module_of(&p), text))
        .collect();
    let modules: BTreeSet<String> = files.iter().map(|(m, _)| m.clone()).collect();
    // The longest module a path starts with.
    let resolve = |path: &[&str]| {
        (1..=path.len()).rev().map(|k| path[..k].join("::")).find(|m| modules.contains(m))
    };
    let related = |a: &str, b: &str| {
        b.is_empty()
            || a.is_empty()
            || a.starts_with(&format!("{b}::"))
            || b.starts_with(&format!("{a}::"))
    };
    let mut imports = BTreeMap::new();
    for (module, text) in &files {
        let mut named = BTreeSet::new();
        for line in code_lines(text) {
            let code = line.split("//").next().unwrap_or("");
            for (prefix, base) in [
                ("crate::", Vec::new()),
                ("super::", {
                    let mut p: Vec<&str> = module.split("::").collect();
                    p.pop();
                    p
                }),
            ] {
                for (at, _) in code.match_indices(prefix) {
                    let before = code[..at].chars().last();
                    if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                        continue;
                    }
                    let rest = &code[at + prefix.len()..];
                    // `use crate::{a, b::c}` names each of a and b.
                    let heads: Vec<String> = if let Some(list) = rest.strip_prefix('{') {
                        let list = list.split('}').next().unwrap_or("");
                        list.split(',').map(|s| s.trim().to_string()).collect()
                    } else {
                        vec![rest.to_string()]
                    };
                    for head in heads {
                        let segs: Vec<&str> = head
                            .split("::")
                            .map(|s| s.trim_matches(|c: char| !(c.is_alphanumeric() || c == '_')))
                            .take_while(|s| {
                                !s.is_empty()
                                    && s.chars()
                                        .all(|c| c.is_lowercase() || c.is_ascii_digit() || c == '_')
                            })
                            .collect();
                        let mut full: Vec<&str> = base.clone();
                        full.extend(segs);
                        if let Some(m) = resolve(&full) {
                            if m != *module && !related(module, &m) {
                                named.insert(m);
                            }
                        }
                    }
                }
            }
        }
        imports.insert(module.clone(), named);
    }
    imports
}

/// The modules that import each other in a circle: every cycle's members, found by following
/// imports from each module.
fn import_circles(imports: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(m) = todo.pop() {
            for n in imports.get(&m).into_iter().flatten() {
                if seen.insert(n.clone()) {
                    todo.push(n.clone());
                }
            }
        }
        seen
    };
    let reachable: BTreeMap<&String, BTreeSet<String>> =
        imports.keys().map(|m| (m, reach(m))).collect();
    let mut circles: Vec<BTreeSet<String>> = Vec::new();
    for (m, r) in &reachable {
        if !r.contains(*m) {
            continue;
        }
        let circle: BTreeSet<String> =
            r.iter().filter(|n| reachable[n].contains(*m)).cloned().collect();
        if !circles.contains(&circle) {
            circles.push(circle);
        }
    }
    circles
}

/// Layers inside a crate too: no two files of tandem-comm, tandem-state or tandem-train import
/// each other, directly or through others (a module and its own submodules aside).
#[test]
fn comm_and_train_files_import_in_one_direction() {
    for krate in ["tandem-comm", "tandem-state", "tandem-train"] {
        let imports = module_imports(&repo().join("crates").join(krate).join("src"));
        assert!(imports.len() > 10, "{krate}: only {} modules found", imports.len());
        let circles = import_circles(&imports);
        assert!(circles.is_empty(), "{krate}: files import each other in a circle: {circles:?}");
    }
}

/// The check above sees a circle where there is one.
#[test]
fn an_import_circle_is_found() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
    write("lib.rs", "mod a;\nmod b;\nmod c;\n");
    write("a.rs", "use crate::b::Thing;\n");
    write("b.rs", "pub struct Thing;\nfn f() { crate::c::g() }\n");
    write("c.rs", "use crate::{a, d};\n");
    let circles = import_circles(&module_imports(dir.path()));
    let want: BTreeSet<String> = ["a", "b", "c"].map(String::from).into();
    assert_eq!(circles, vec![want]);
    write("c.rs", "pub fn g() {}\n");
    assert!(import_circles(&module_imports(dir.path())).is_empty());
}
