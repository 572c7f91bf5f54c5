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

/// The training library and its recipes report typed events and `tracing` warnings; only the
/// binary prints.
#[test]
fn the_training_library_never_prints() {
    let mut found = Vec::new();
    let sources = ["crates/tandem-train/src", "crates/tandem-recipes/src"]
        .iter()
        .flat_map(|dir| tandem_testutil::files_with_text(&repo().join(dir)));
    for (path, text) in sources {
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if ["println!", "eprintln!", "print!", "eprint!", "dbg!"]
                .iter()
                .any(|m| code.contains(m))
            {
                found.push(format!("{}:{}: {}", path.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "the training library prints:\n{}", found.join("\n"));
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
    ("tandem-dylib", &[]),
    ("tandem-launch", &[]),
    ("tandem-models", &[]),
    ("tandem-nn", &["convert", "functional", "kernels", "torch_init", "weights"]),
    ("tandem-onnx", &["error", "graph", "models", "proto"]),
    ("tandem-optim", &["amp", "lr_scheduler", "zero"]),
    ("tandem-partial-fc", &[]),
    ("tandem-recipes", &["face", "ijb", "options", "verification"]),
    ("tandem-testutil", &["child", "harness", "netns", "procs", "world"]),
    ("tandem-train", &["checkpoint", "events", "fault", "live", "metrics", "schedule", "state"]),
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
