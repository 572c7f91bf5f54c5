//! `tandem bench report --quick` end to end: runs the real benches (and PyTorch's peers when a
//! Python with torch is found; required under TANDEM_REQUIRE_TORCH=1), then checks the markdown
//! has every section with numbers, that each printed ratio is the printed figure over the printed
//! in-run reference, and that the plots are real PNGs.
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// The table rows of the section whose heading starts with `heading`, keyed by (case, contender).
fn section_rows(md: &str, heading: &str) -> HashMap<(String, String), Vec<String>> {
    let start = md
        .find(&format!("\n## {heading}"))
        .unwrap_or_else(|| panic!("no section {heading:?} in:\n{md}"));
    let body = &md[start + 1..];
    let end = body[3..].find("\n## ").map(|e| e + 3).unwrap_or(body.len());
    body[..end]
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| case"))
        .map(|l| {
            let cells: Vec<String> =
                l.trim_matches('|').split('|').map(|c| c.trim().to_string()).collect();
            ((cells[0].clone(), cells[1].clone()), cells)
        })
        .collect()
}

fn num(cell: &str, what: &str) -> f64 {
    cell.parse().unwrap_or_else(|_| panic!("{what}: {cell:?} is not a number"))
}

/// Whether the printed ratio `shown` is `numer / denom` as printed: each cell is rounded to its
/// decimals, so the true quotient lies between the quotients of the cells' bounds (a time of
/// 0.0041 ms is 0.00405..0.00415, ±1.2%), and the ratio itself is rounded to its own.
fn ratio_of_cells(shown: &str, numer: &str, denom: &str) -> bool {
    let half = |cell: &str| 0.5 * 10f64.powi(-(cell.split('.').nth(1).map_or(0, str::len) as i32));
    let (r, n, d) = (num(shown, "ratio"), num(numer, "numerator"), num(denom, "denominator"));
    let low = (n - half(numer)) / (d + half(denom)) - half(shown);
    let high = (n + half(numer)) / (d - half(denom)).max(f64::MIN_POSITIVE) + half(shown);
    (low..=high).contains(&r)
}

/// Checks one measured row: min <= median <= max, its reference column is the reference row's
/// median, and "× reference" = median / reference within the printed precision.
fn check_row(
    rows: &HashMap<(String, String), Vec<String>>,
    case: &str,
    contender: &str,
    reference: (&str, &str),
) -> f64 {
    let key = (case.to_string(), contender.to_string());
    let r = rows
        .get(&key)
        .unwrap_or_else(|| panic!("no row {key:?} in {:?}", rows.keys().collect::<Vec<_>>()));
    let what = format!("{case} {contender}");
    let (median, min, max) = (num(&r[2], &what), num(&r[3], &what), num(&r[4], &what));
    assert!(median > 0.0 && min <= median && median <= max, "{what}: {r:?}");
    let ref_row = &rows[&(reference.0.to_string(), reference.1.to_string())];
    assert_eq!(r[5], ref_row[2], "{what}: the reference column is the reference row's median");
    let expected = median / num(&r[5], &what);
    let printed = num(&r[6], &what);
    // Figures carry 4 significant digits (<= 0.05% off each), ratios 3 decimals.
    assert!(
        (printed - expected).abs() <= 0.0005 + 0.0011 * expected,
        "{what}: ratio {printed} but {median}/{} = {expected}",
        r[5]
    );
    median
}

fn check_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{} is not a PNG", path.display());
    assert_eq!(&bytes[12..16], b"IHDR");
    let width = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let height = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    assert!(width >= 800 && height >= 500, "{}: {width}x{height}", path.display());
    // A blank canvas of that size compresses to a few KiB; lines, text and bars do not.
    assert!(bytes.len() > 20_000, "{}: only {} bytes", path.display(), bytes.len());
}

#[test]
fn quick_report_has_every_section_ratio_and_plot() {
    let dir = tempfile::tempdir().unwrap();
    let torch = tandem_testutil::torch_python();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem"));
    cmd.args(["bench", "report", "--quick", "--out"]).arg(dir.path());
    // Without torch, point --python at nothing so the "not available" path is what gets checked.
    cmd.arg("--python").arg(torch.clone().unwrap_or_else(|| dir.path().join("no-such-python")));
    let out = tandem_testutil::output_with_deadline(&mut cmd, Duration::from_secs(240));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench report failed:\n{stderr}");
    let md = std::fs::read_to_string(dir.path().join("BENCHMARKS.md")).unwrap();

    assert!(
        md.contains("cargo build --release && target/release/tandem bench report"),
        "the regenerate command is named"
    );
    for key in [
        "| CPU | ",
        "| cores | ",
        "| load average (1/5/15 min) before | ",
        "| load average (1/5/15 min) after | ",
        "| git commit | ",
    ] {
        let line =
            md.lines().find(|l| l.starts_with(key)).unwrap_or_else(|| panic!("no {key:?} line"));
        assert!(line.len() > key.len() + 2, "{line}");
    }
    let load = md.lines().find(|l| l.starts_with("| load average (1/5/15 min) before")).unwrap();
    let loads: Vec<&str> = load.split('|').nth(2).unwrap().split_whitespace().collect();
    assert_eq!(loads.len(), 3, "{load}");
    loads.iter().for_each(|l| assert!(num(l, "load average") >= 0.0));
    assert!(md.contains("## Noise"));

    let ar = section_rows(&md, "all_reduce bus bandwidth");
    assert_eq!(
        check_row(&ar, "1 MiB", "memcpy", ("1 MiB", "memcpy")),
        num(&ar[&("1 MiB".into(), "memcpy".into())][5], "memcpy")
    );
    assert_eq!(ar[&("1 MiB".into(), "memcpy".into())][6], "1.000");
    for size in ["4 B", "4 KiB", "1 MiB"] {
        check_row(&ar, size, "tandem tcp", (size, "memcpy"));
        check_row(&ar, size, "tandem shm", (size, "memcpy"));
    }
    let ddp = section_rows(&md, "DDP training throughput");
    check_row(&ddp, "1 process", "plain (no Ddp)", ("1 process", "plain (no Ddp)"));
    let tandem_ddp = check_row(&ddp, "2 ranks", "tandem Ddp", ("1 process", "plain (no Ddp)"));
    for heading in [
        "DDP training throughput, Cnn 1x28x28 (conv8-bn-pool-conv16-pool-fc)",
        "DDP training throughput, ResNet-18 (CIFAR) width 4",
    ] {
        let rows = section_rows(&md, heading);
        check_row(&rows, "2 ranks", "tandem Ddp", ("1 process", "plain (no Ddp)"));
        if torch.is_some() {
            check_row(&rows, "2 ranks", "PyTorch DDP (gloo)", ("1 process", "plain (no Ddp)"));
        }
    }
    for (heading, rows) in [
        (
            "Conv-net kernels per op, ResNet-18 (CIFAR) width 4",
            vec![("conv2d", "stem_3x3"), ("conv2d", "layer2_1x1_s2"), ("batch_norm", "bn_4x32x32")],
        ),
        (
            "Conv-net kernels per op, IResNet-18 (112x112) width 4",
            vec![
                ("conv2d", "layer1_3x3_s1_in"),
                ("batch_norm", "bn_4x112x112"),
                ("prelu", "prelu_8x56x56"),
            ],
        ),
    ] {
        let ops = section_rows(&md, heading);
        for (kind, name) in rows {
            let row = ops
                .get(&(kind.to_string(), name.to_string()))
                .unwrap_or_else(|| panic!("no {kind} {name} row in {ops:?}"));
            assert!(
                num(&row[2], "tandem fwd ms") > 0.0 && num(&row[5], "tandem fwd+bwd ms") > 0.0,
                "{row:?}"
            );
            if torch.is_some() {
                // × torch fwd = torch fwd / tandem fwd
                assert!(ratio_of_cells(&row[4], &row[3], &row[2]), "{row:?}");
            }
            // Convolutions that go through Winograd's algorithm are timed both ways; the gain is
            // their ratio. (At width 4 the first stage has too few channels for it.)
            if name.contains("3x3_s1") && !name.starts_with("layer1") {
                // Winograd gain = im2col fwd+bwd / tandem fwd+bwd
                assert!(ratio_of_cells(&row[15], &row[14], &row[5]), "{row:?}");
            } else {
                assert_eq!(row[15], "–", "{row:?}");
            }
            // A convolution is also timed with each backward alone (a stem's input, the data,
            // takes no gradient); other ops have neither.
            if kind == "conv2d" {
                if name.starts_with("stem") {
                    assert_eq!(row[8], "–", "{row:?}");
                } else {
                    assert!(num(&row[8], "tandem fwd+bwd-data") > 0.0, "{row:?}");
                }
                assert!(num(&row[11], "tandem fwd+bwd-filter") > 0.0, "{row:?}");
            } else {
                assert_eq!((row[8].as_str(), row[11].as_str()), ("–", "–"), "{row:?}");
            }
        }
    }
    let ck = section_rows(&md, "Checkpoint save / load");
    check_row(&ck, "save", "tandem .pt", ("save", "dd conv=fsync (write)"));
    check_row(&ck, "save", "tandem safetensors", ("save", "dd conv=fsync (write)"));
    check_row(&ck, "load", "tandem .pt (mmap)", ("load", "dd (read, warm cache)"));
    // The save-stall section holds the bench's table: every row with three positive numbers.
    let stall = md
        .split("\n## Checkpoint save stall: synchronous vs background writes")
        .nth(1)
        .expect("a save-stall section");
    for row in [
        "training step without a save",
        "stall of a save step: synchronous",
        "stall of a save step: background",
        "run time added per save: background",
    ] {
        let line = stall.lines().find(|l| l.starts_with(row)).unwrap_or_else(|| panic!("no {row}"));
        let values: Vec<f64> = line[row.len()..].split_whitespace().map(|v| num(v, row)).collect();
        assert_eq!(values.len(), 3, "{line}");
        assert!(values[0] <= values[1] && values[1] <= values[2], "min <= median <= max: {line}");
    }
    assert!(stall.contains("stall synchronous / background (medians): "), "{stall}");
    // The ZeRO section: one row per rank of the 2-rank run; the shares add up to the whole.
    let zero = md.split("\n## ZeRO-1: optimizer state per rank").nth(1).expect("a ZeRO section");
    let shares: Vec<f64> = zero
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() == 6 && f[0] == "2")
        .map(|f| num(f[3], "x unsharded"))
        .collect();
    assert_eq!(shares.len(), 2, "{zero}");
    assert!((shares.iter().sum::<f64>() - 1.0).abs() < 0.01, "{shares:?}");
    // The face recipe against PyTorch running it: both sides' samples/s and their ratio, or
    // why it was not measured.
    let face = md.split("\n## The face-recognition recipe").nth(1).expect("a face section");
    let face = face.split("\n## ").next().unwrap_or(face);
    if torch.is_some() {
        let median = |side: &str| {
            let line = face
                .lines()
                .find(|l| l.trim_start().starts_with(side))
                .unwrap_or_else(|| panic!("no {side} row: {face}"));
            let after = line.split("median ").nth(1).expect("a median");
            num(after.split_whitespace().next().unwrap(), side)
        };
        let (ours, theirs) = (median("tandem "), median("PyTorch (gloo DDP + PartialFC v2)"));
        let ratio = face
            .split("(medians): samples/s ")
            .nth(1)
            .and_then(|r| r.split('x').next())
            .map(|r| num(r, "ratio"))
            .expect("a ratio");
        assert!(
            (ratio - ours / theirs).abs() <= 0.006 + 0.01 * ratio,
            "{ratio} vs {ours} / {theirs}: {face}"
        );
        // Both sides' memory (the largest rank's peak) and its ratio, and both breakdowns.
        let gib = |side: &str| {
            let line = face.lines().find(|l| l.trim_start().starts_with(side)).expect("a row");
            let after = line.split("(GiB) ").nth(1).expect("a memory figure");
            num(after.split("median ").nth(1).unwrap().split_whitespace().next().unwrap(), side)
        };
        let (ours_mem, theirs_mem) = (gib("tandem "), gib("PyTorch (gloo DDP + PartialFC v2)"));
        assert!(ours_mem > 0.0 && theirs_mem > 0.0, "{face}");
        let mem_ratio = face
            .split("peak memory per rank ")
            .nth(1)
            .and_then(|r| r.split('x').next())
            .map(|r| num(r, "memory ratio"))
            .expect("a memory ratio");
        assert!(
            (mem_ratio - ours_mem / theirs_mem).abs() <= 0.02 + 0.2 * mem_ratio,
            "{mem_ratio} vs {ours_mem} / {theirs_mem}: {face}"
        );
        assert!(face.contains("time per step on rank 0"), "{face}");
        assert!(face.contains("PyTorch: time per step on rank 0 (ms): data="), "{face}");
    } else {
        assert!(face.contains("Not measured: PyTorch not available"), "{face}");
    }

    if torch.is_some() {
        let gloo = check_row(&ar, "1 MiB", "gloo (PyTorch)", ("1 MiB", "memcpy"));
        let shm_row = &ar[&("1 MiB".into(), "tandem shm".into())];
        let vs = num(&shm_row[7], "shm × PyTorch");
        let expected = num(&shm_row[2], "shm") / gloo;
        assert!(
            (vs - expected).abs() <= 0.0005 + 0.0011 * expected,
            "tandem shm / gloo: {vs} vs {expected}"
        );
        let torch_ddp =
            check_row(&ddp, "2 ranks", "PyTorch DDP (gloo)", ("1 process", "plain (no Ddp)"));
        let vs = num(&ddp[&("2 ranks".into(), "tandem Ddp".into())][7], "Ddp × PyTorch");
        assert!(
            (vs - tandem_ddp / torch_ddp).abs() <= 0.0005 + 0.0011 * vs,
            "tandem Ddp / PyTorch DDP: {vs}"
        );
        check_row(&ck, "save", "torch.save + fsync", ("save", "dd conv=fsync (write)"));
        check_row(&ck, "load", "torch.load(mmap=True)", ("load", "dd (read, warm cache)"));
        assert!(!md.contains("PyTorch not available"), "torch was given: {md}");
    } else {
        for (rows, key) in [
            (&ar, ("1 MiB", "gloo (PyTorch)")),
            (&ddp, ("2 ranks", "PyTorch DDP (gloo)")),
            (&ck, ("save", "torch.save + fsync")),
        ] {
            let r = &rows[&(key.0.to_string(), key.1.to_string())];
            assert_eq!(r[2], "PyTorch not available", "{r:?}");
        }
        assert!(md.lines().any(|l| l.starts_with("| PyTorch | PyTorch not available")), "{md}");
    }

    for png in [
        "allreduce_busbw.png",
        "ddp_samples_per_s.png",
        "ddp_cnn_samples_per_s.png",
        "ddp_resnet18_w4_samples_per_s.png",
        "ckpt_throughput.png",
    ] {
        check_png(&dir.path().join(png));
    }
    // Scratch files of the checkpoint runs are cleaned up.
    let left: Vec<_> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 6, "only the report and 5 plots remain: {left:?}");
}

#[test]
fn report_rejects_zero_repeats() {
    let dir = tempfile::tempdir().unwrap();
    let out = tandem_testutil::output_with_deadline(
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["bench", "report", "--quick", "--repeats", "0", "--out"])
            .arg(dir.path()),
        Duration::from_secs(30),
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--repeats"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The rows of a `bench ops` table: (kind, name, cells after the name).
fn ops_rows(out: &str) -> Vec<(String, String, Vec<String>)> {
    out.lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| op "))
        .map(|l| {
            let cells: Vec<String> =
                l.trim_matches('|').split('|').map(|c| c.trim().to_string()).collect();
            (cells[0].clone(), cells[1].clone(), cells[2..].to_vec())
        })
        .collect()
}

/// `tandem bench ops` on the face backbones: every op of the ViT's and MobileFaceNet's steps
/// is timed as the step runs it — the ViT's patch embedding and its fc1 + ReLU6 are ops of
/// their own — with a number in tandem's columns and PyTorch's beside it when torch is here
/// (the bench has then checked each op's output sum equal on both sides), and the caption
/// names the CPU and its vector extensions.
#[test]
fn ops_bench_times_every_op_of_the_face_backbones_against_pytorch() {
    let torch = tandem_testutil::torch_python();
    if torch.is_none() {
        eprintln!("SKIPPED the PyTorch columns: no Python with torch (TANDEM_PYTHON)");
    }
    for (net, kinds) in [
        (
            "vit_t",
            &["patch_embed", "layer_norm", "linear", "linear_relu6", "attention", "sgd", "adamw"][..],
        ),
        ("mbf", &["conv2d", "batch_norm", "prelu", "linear", "sgd"][..]),
    ] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem"));
        // Batch 2: the feature head's BatchNorm1d needs two values a channel in training.
        cmd.args(["bench", "ops", "--net", net, "--batch", "2", "--repeats", "1"]);
        if let Some(py) = &torch {
            cmd.arg("--torch").arg(py);
        }
        let out = cmd.env("RAYON_NUM_THREADS", "1").output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{net}: {text}\n{}", String::from_utf8_lossy(&out.stderr));
        let caption = text.lines().find(|l| l.contains(" ops at width")).expect("a caption");
        assert!(caption.contains("on cpu: ") && caption.contains('('), "{caption}");
        let rows = ops_rows(&text);
        for kind in kinds {
            assert!(rows.iter().any(|r| r.0 == *kind), "{net}: no {kind} row in\n{text}");
        }
        for (kind, name, cells) in &rows {
            let (ours, theirs) = (&cells[0], &cells[1]);
            assert!(ours.parse::<f64>().is_ok_and(|v| v > 0.0), "{net} {kind} {name}: {cells:?}");
            if torch.is_some() {
                assert!(theirs.parse::<f64>().is_ok_and(|v| v > 0.0), "{net} {name}: {cells:?}");
            }
        }
    }
}

/// A peer whose values differ from tandem's (a stand-in printing wrong sums) fails the run,
/// naming the op: the two sides must time the same computation.
#[test]
fn ops_bench_refuses_a_peer_that_computes_something_else() {
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("fake-python");
    // Reads the op list like the real peer and answers every op with a sum of 12345.
    std::fs::write(
        &fake,
        "#!/usr/bin/env python3\nimport json, sys\nfor op in json.load(sys.stdin):\n    \
         print('RESULT ' + json.dumps({'name': op['name'], 'fwd_ms': 1.0, 'fwdbwd_ms': 2.0, \
         'sum': 12345.0, 'abs_sum': 12345.0}))\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["bench", "ops", "--net", "resnet18", "--width", "2", "--batch", "1"])
        .args(["--repeats", "1", "--torch"])
        .arg(&fake)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("op stem_3x3") && err.contains("do not time the same op"), "{err}");
}
