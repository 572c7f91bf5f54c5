//! DistributedSampler and randperm against real PyTorch output: the committed fixtures (made by
//! tests/fixtures/make_fixtures.py) and, when a Python with torch is present, fresh cases.
use std::path::PathBuf;

use serde_json::Value;
use tandem_data::{torch_randperm, DistributedSampler};

fn fixture(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Same checksum as make_fixtures.py.
fn checksum(perm: &[usize]) -> u64 {
    perm.iter().enumerate().fold(0u64, |acc, (i, &p)| {
        acc.wrapping_add(
            (p as u64).wrapping_mul((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
        )
    })
}

fn usizes(v: &Value) -> Vec<usize> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("index") as usize).collect()
}

fn check_perm_summary(entry: &Value, perm: &[usize]) {
    let n = entry["n"].as_u64().unwrap() as usize;
    let seed = entry["seed"].as_u64().unwrap();
    assert_eq!(perm.len(), n);
    if let Some(full) = entry.get("perm") {
        assert_eq!(perm, usizes(full), "randperm({n}) seed {seed}");
    } else {
        let head = usizes(&entry["head"]);
        let tail = usizes(&entry["tail"]);
        assert_eq!(&perm[..head.len()], &head[..], "randperm({n}) seed {seed}: head");
        assert_eq!(&perm[n - tail.len()..], &tail[..], "randperm({n}) seed {seed}: tail");
    }
    let want: u64 = entry["checksum"].as_str().unwrap().parse().unwrap();
    assert_eq!(checksum(perm), want, "randperm({n}) seed {seed}: checksum");
}

#[test]
fn randperm_matches_torch_fixture() {
    let fx = fixture("randperm.json");
    let perms = fx["perms"].as_array().unwrap();
    assert!(perms.len() >= 20);
    for entry in perms {
        let n = entry["n"].as_u64().unwrap() as usize;
        check_perm_summary(entry, &torch_randperm(n, entry["seed"].as_u64().unwrap()));
    }
}

/// Both sides of torch's switch to the 64-bit inside-out shuffle at n = (2^32 - 1) / 20.
/// Needs ~3.5 GB of memory and about a minute at opt-level 1, hence ignored; run with
/// `cargo test -p tandem-data --test torch_parity -- --ignored`.
#[test]
#[ignore]
fn randperm_matches_torch_at_large_n_threshold() {
    let fx = fixture("randperm_large.json");
    let perms = fx["perms"].as_array().unwrap();
    assert_eq!(perms.len(), 2);
    assert_eq!(perms[1]["n"].as_u64().unwrap() as usize, tandem_data::randperm::LARGE_N_THRESHOLD);
    for entry in perms {
        let n = entry["n"].as_u64().unwrap() as usize;
        check_perm_summary(entry, &torch_randperm(n, entry["seed"].as_u64().unwrap()));
    }
}

fn check_case(case: &Value) {
    let len = case["len"].as_u64().unwrap() as usize;
    let replicas = case["num_replicas"].as_u64().unwrap() as usize;
    let shuffle = case["shuffle"].as_bool().unwrap();
    let seed = case["seed"].as_u64().unwrap();
    let epoch = case["epoch"].as_u64().unwrap();
    let drop_last = case["drop_last"].as_bool().unwrap();
    let ranks = case["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), replicas);
    for (rank, want) in ranks.iter().enumerate() {
        let mut s = DistributedSampler::new(len, replicas, rank, shuffle, seed, drop_last).unwrap();
        s.set_epoch(epoch);
        let want = usizes(want);
        assert_eq!(s.len(), want.len(), "len of {case_id}", case_id = describe(case, rank));
        assert_eq!(s.indices(), want, "{}", describe(case, rank));
    }
}

fn describe(case: &Value, rank: usize) -> String {
    format!(
        "len={} replicas={} rank={rank} shuffle={} seed={} epoch={} drop_last={}",
        case["len"],
        case["num_replicas"],
        case["shuffle"],
        case["seed"],
        case["epoch"],
        case["drop_last"]
    )
}

#[test]
fn distributed_sampler_matches_torch_fixture() {
    let fx = fixture("distributed_sampler.json");
    let cases = fx["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 20);
    for case in cases {
        check_case(case);
    }
}

/// Fresh cases from the installed torch (skipped without one, unless TANDEM_REQUIRE_TORCH=1).
#[test]
fn distributed_sampler_matches_live_torch() {
    let Some(python) = tandem_testutil::torch_python() else {
        return;
    };
    let script = r#"
import json, sys
from torch.utils.data import DistributedSampler
cases = []
for (n, r, sh, seed, ep, dl) in [(333, 5, True, 99, 4, False), (333, 5, True, 99, 4, True),
                                 (64, 64, True, 3, 0, False), (50, 9, False, 0, 0, False),
                                 (123457, 4, True, 2**40 + 11, 12, False)]:
    ranks = []
    for rank in range(r):
        s = DistributedSampler(range(n), num_replicas=r, rank=rank, shuffle=sh, seed=seed, drop_last=dl)
        s.set_epoch(ep)
        ranks.append(list(iter(s)))
    cases.append(dict(len=n, num_replicas=r, shuffle=sh, seed=seed, epoch=ep, drop_last=dl, ranks=ranks))
json.dump(cases, sys.stdout)
"#;
    let out = tandem_testutil::output_with_deadline(
        std::process::Command::new(python).args(["-c", script]),
        std::time::Duration::from_secs(120),
    );
    assert!(out.status.success(), "torch script failed: {}", String::from_utf8_lossy(&out.stderr));
    let cases: Value = serde_json::from_slice(&out.stdout).unwrap();
    for case in cases.as_array().unwrap() {
        check_case(case);
    }
}
