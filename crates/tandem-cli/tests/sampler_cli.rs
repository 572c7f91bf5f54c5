//! `tandem sampler` end to end: output equals PyTorch's DistributedSampler (live torch when
//! present, else the library, itself checked against committed torch fixtures), and bad flags
//! fail with a message naming them.
use std::process::Command;
use std::time::Duration;

fn tandem(args: &[&str]) -> std::process::Output {
    tandem_testutil::output_with_deadline(
        Command::new(env!("CARGO_BIN_EXE_tandem")).arg("sampler").args(args),
        Duration::from_secs(60),
    )
}

fn indices(args: &[&str]) -> Vec<usize> {
    let out = tandem(args);
    assert!(
        out.status.success(),
        "tandem sampler {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is a JSON array of indices")
}

#[test]
fn unshuffled_padding_is_torchs() {
    // 10 samples over 4 ranks: rank 3 gets [3, 7] plus the padding sample 1.
    assert_eq!(indices(&["--len", "10", "--replicas", "4", "--rank", "3"]), vec![3, 7, 1]);
    assert_eq!(
        indices(&["--len", "10", "--replicas", "4", "--rank", "3", "--drop-last"]),
        vec![3, 7]
    );
}

#[test]
fn matches_live_torch() {
    let Some(python) = tandem_testutil::torch_python() else {
        return;
    };
    let cases = [
        (1000usize, 8usize, 3usize, 17i64, 5u64, false),
        (97, 4, 0, 0, 2, true),
        (5, 7, 6, 2, 1, false),
        (300, 3, 1, -5, 3, false), // torch wraps negative seeds modulo 2^64
    ];
    let py_cases = cases
        .iter()
        .map(|(n, r, k, s, e, d)| {
            format!("({n}, {r}, {k}, {s}, {e}, {})", if *d { "True" } else { "False" })
        })
        .collect::<Vec<_>>()
        .join(", ");
    // One interpreter for all cases: importing torch dominates the run time.
    let script = format!(
        "import json\nfrom torch.utils.data import DistributedSampler\nout = []\n\
         for (n, r, rank, seed, epoch, dl) in [{py_cases}]:\n\
         \x20   s = DistributedSampler(range(n), num_replicas=r, rank=rank, shuffle=True, seed=seed, drop_last=dl)\n\
         \x20   s.set_epoch(epoch)\n\
         \x20   out.append(list(iter(s)))\n\
         print(json.dumps(out))"
    );
    let out = tandem_testutil::output_with_deadline(
        Command::new(&python).args(["-c", &script]),
        Duration::from_secs(120),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want: Vec<Vec<usize>> = serde_json::from_slice(&out.stdout).unwrap();
    for ((len, r, rank, seed, epoch, drop_last), want) in cases.iter().zip(want) {
        let (len_s, r_s, rank_s, seed_s, epoch_s) =
            (len.to_string(), r.to_string(), rank.to_string(), seed.to_string(), epoch.to_string());
        let mut args = vec![
            "--len",
            &len_s,
            "--replicas",
            &r_s,
            "--rank",
            &rank_s,
            "--shuffle",
            "--seed",
            &seed_s,
            "--epoch",
            &epoch_s,
        ];
        if *drop_last {
            args.push("--drop-last");
        }
        assert_eq!(indices(&args), want, "tandem sampler {args:?}");
    }
}

#[test]
fn every_rank_agrees_with_the_library() {
    for rank in 0..5 {
        let mut s = tandem::data::DistributedSampler::new(123, 5, rank, true, 9, false).unwrap();
        s.set_epoch(4);
        let rank_s = rank.to_string();
        let got = indices(&[
            "--len",
            "123",
            "--replicas",
            "5",
            "--rank",
            &rank_s,
            "--shuffle",
            "--seed",
            "9",
            "--epoch",
            "4",
        ]);
        assert_eq!(got, s.indices());
    }
}

#[test]
fn rank_out_of_range_fails_naming_the_rank() {
    let out = tandem(&["--len", "10", "--replicas", "4", "--rank", "4"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 4") && err.contains("num_replicas 4"), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn zero_replicas_and_missing_flags_fail() {
    let out = tandem(&["--len", "10", "--replicas", "0", "--rank", "0"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("num_replicas"));
    let out = tandem(&["--len", "10", "--rank", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--replicas"));
    let out = tandem(&["--len", "-3", "--replicas", "2", "--rank", "0"]);
    assert!(!out.status.success());
}
