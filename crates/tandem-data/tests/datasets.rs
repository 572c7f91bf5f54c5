//! The embedded digits, MNIST IDX reading (gz and raw, and its errors), synthetic data and
//! dataset specs.
use std::io::Write;
use std::path::Path;

use tandem_data::{datasets, Dataset};

#[test]
fn digits_split_and_values() {
    let (train, eval) = datasets::digits().unwrap();
    assert_eq!((train.len(), eval.len()), (1500, 297));
    assert_eq!((train.input_dim(), train.num_classes()), (64, 10));
    assert_eq!((eval.input_dim(), eval.num_classes()), (64, 10));
    // First row of sklearn's digits.csv.gz (a zero): 0,0,5,13,9,1,0,0,... label 0.
    let first = train.get(0).unwrap();
    assert_eq!(first.label, 0);
    assert_eq!(
        &first.features[..8],
        &[0.0, 0.0, 5.0 / 16.0, 13.0 / 16.0, 9.0 / 16.0, 1.0 / 16.0, 0.0, 0.0]
    );
    // Eval rows are sorted(torch.randperm(1797, generator=torch.Generator().manual_seed(0))[1500:])
    // (values printed by torch 2.15): rows 1, 2, 5, 7, 18, ..., 1788, 1794, 1795; train starts 0, 3, 4.
    let all = datasets::digits_all().unwrap();
    for (i, row) in [(0, 1), (1, 2), (2, 5), (3, 7), (4, 18), (294, 1788), (295, 1794), (296, 1795)]
    {
        assert_eq!(
            eval.get(i).unwrap(),
            all.get(row).unwrap(),
            "eval row {i} should be file row {row}"
        );
    }
    for (i, row) in [(0, 0), (1, 3), (2, 4)] {
        assert_eq!(
            train.get(i).unwrap(),
            all.get(row).unwrap(),
            "train row {i} should be file row {row}"
        );
    }
    // Known class counts of the UCI digits test set (sklearn's load_digits): 178 zeros, 182 ones, ...
    let mut counts = [0usize; 10];
    for &l in all.labels() {
        counts[l as usize] += 1;
    }
    assert_eq!(counts, [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]);
    let max = (0..all.len()).flat_map(|i| all.get(i).unwrap().features).fold(0f32, f32::max);
    assert_eq!(max, 1.0);
    assert_eq!(datasets::from_spec("digits").unwrap().1, eval);
}

fn idx_bytes(magic3: u8, dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut b = vec![0, 0, 0x08, magic3];
    for d in dims {
        b.extend_from_slice(&d.to_be_bytes());
    }
    b.extend_from_slice(data);
    b
}

fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

/// A 3-image 2x2 train split and a 2-image test split; `compress` picks .gz or raw files.
fn write_mnist(dir: &Path, compress: bool) {
    let files = [
        (
            "train-images-idx3-ubyte",
            idx_bytes(3, &[3, 2, 2], &[0, 255, 51, 102, 1, 2, 3, 4, 255, 255, 0, 0]),
        ),
        ("train-labels-idx1-ubyte", idx_bytes(1, &[3], &[7, 0, 9])),
        ("t10k-images-idx3-ubyte", idx_bytes(3, &[2, 2, 2], &[10, 20, 30, 40, 50, 60, 70, 80])),
        ("t10k-labels-idx1-ubyte", idx_bytes(1, &[2], &[3, 4])),
    ];
    for (name, bytes) in files {
        if compress {
            std::fs::write(dir.join(format!("{name}.gz")), gz(&bytes)).unwrap();
        } else {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    }
}

#[test]
fn mnist_reads_gz_and_raw_idx() {
    for compress in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        write_mnist(dir.path(), compress);
        let spec = format!("mnist:{}", dir.path().display());
        let (train, eval) = datasets::from_spec(&spec).unwrap();
        assert_eq!((train.len(), train.input_dim(), train.num_classes()), (3, 4, 10));
        let ex = train.get(0).unwrap();
        assert_eq!(ex.features, vec![0.0, 1.0, 0.2, 0.4]);
        assert_eq!(ex.label, 7);
        assert_eq!(train.get(2).unwrap().label, 9);
        assert_eq!(eval.len(), 2);
        assert_eq!(
            eval.get(1).unwrap().features,
            vec![50.0 / 255.0, 60.0 / 255.0, 70.0 / 255.0, 80.0 / 255.0]
        );
        assert_eq!(eval.get(1).unwrap().label, 4);
    }
}

fn err_of(dir: &Path) -> String {
    datasets::mnist(dir).unwrap_err().to_string()
}

#[test]
fn mnist_errors_name_the_file() {
    // Wrong magic: a label file where the images should be.
    let dir = tempfile::tempdir().unwrap();
    write_mnist(dir.path(), false);
    std::fs::write(dir.path().join("train-images-idx3-ubyte"), idx_bytes(1, &[3], &[0, 1, 2]))
        .unwrap();
    let e = err_of(dir.path());
    assert!(e.contains("train-images-idx3-ubyte") && e.contains("magic"), "{e}");

    // Truncated data.
    write_mnist(dir.path(), false);
    let full = idx_bytes(3, &[3, 2, 2], &[0; 12]);
    std::fs::write(dir.path().join("train-images-idx3-ubyte"), &full[..full.len() - 5]).unwrap();
    let e = err_of(dir.path());
    assert!(e.contains("train-images-idx3-ubyte") && e.contains("truncated"), "{e}");

    // Truncated header.
    std::fs::write(dir.path().join("train-images-idx3-ubyte"), &full[..7]).unwrap();
    let e = err_of(dir.path());
    assert!(e.contains("train-images-idx3-ubyte") && e.contains("header"), "{e}");

    // Truncated gzip stream.
    write_mnist(dir.path(), false);
    std::fs::remove_file(dir.path().join("t10k-labels-idx1-ubyte")).unwrap();
    let z = gz(&idx_bytes(1, &[2], &[3, 4]));
    std::fs::write(dir.path().join("t10k-labels-idx1-ubyte.gz"), &z[..z.len() - 6]).unwrap();
    let e = err_of(dir.path());
    assert!(e.contains("t10k-labels-idx1-ubyte.gz") && e.contains("gzip"), "{e}");

    // Label count disagrees with image count.
    write_mnist(dir.path(), false);
    std::fs::remove_file(dir.path().join("t10k-labels-idx1-ubyte.gz")).unwrap();
    std::fs::write(dir.path().join("t10k-labels-idx1-ubyte"), idx_bytes(1, &[3], &[1, 2, 3]))
        .unwrap();
    let e = err_of(dir.path());
    assert!(e.contains("t10k-labels-idx1-ubyte") && e.contains("3 labels"), "{e}");

    // A label that is not a digit.
    write_mnist(dir.path(), false);
    std::fs::write(dir.path().join("train-labels-idx1-ubyte"), idx_bytes(1, &[3], &[1, 12, 3]))
        .unwrap();
    let e = err_of(dir.path());
    assert!(e.contains("train-labels-idx1-ubyte") && e.contains("label 12"), "{e}");

    // Missing file.
    let empty = tempfile::tempdir().unwrap();
    let e = err_of(empty.path());
    assert!(e.contains("train-images-idx3-ubyte") && e.contains("not found"), "{e}");
}

#[test]
fn mnist_finds_torchvision_layout() {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("FashionMNIST/raw");
    std::fs::create_dir_all(&raw).unwrap();
    write_mnist(&raw, true);
    assert_eq!(datasets::mnist(dir.path()).unwrap().0.len(), 3);
}

#[test]
fn synthetic_is_deterministic_and_learnable() {
    let a = datasets::synthetic(500, 16, 4, 3).unwrap();
    assert_eq!(a, datasets::synthetic(500, 16, 4, 3).unwrap());
    assert_ne!(a, datasets::synthetic(500, 16, 4, 4).unwrap());
    assert_eq!((a.len(), a.input_dim(), a.num_classes()), (500, 16, 4));
    // A prefix of a longer set is the shorter set (centers do not depend on n).
    let longer = datasets::synthetic(600, 16, 4, 3).unwrap();
    assert_eq!(longer.get(499).unwrap(), a.get(499).unwrap());
    // Class means are far apart relative to the unit noise: nearest-class-mean classifies well.
    let mut means = vec![vec![0f64; 16]; 4];
    let mut counts = [0usize; 4];
    for i in 0..a.len() {
        let ex = a.get(i).unwrap();
        counts[ex.label as usize] += 1;
        for (m, f) in means[ex.label as usize].iter_mut().zip(&ex.features) {
            *m += f64::from(*f);
        }
    }
    assert!(counts.iter().all(|&c| c > 50), "{counts:?}");
    for (m, c) in means.iter_mut().zip(counts) {
        m.iter_mut().for_each(|v| *v /= c as f64);
    }
    let correct = (0..a.len())
        .filter(|&i| {
            let ex = a.get(i).unwrap();
            let dist = |m: &Vec<f64>| {
                m.iter().zip(&ex.features).map(|(m, f)| (m - f64::from(*f)).powi(2)).sum::<f64>()
            };
            let best = (0..4).min_by(|&x, &y| dist(&means[x]).total_cmp(&dist(&means[y]))).unwrap();
            best as i64 == ex.label
        })
        .count();
    assert!(correct > 400, "{correct}/500");
}

#[test]
fn specs() {
    let (train, eval) = datasets::from_spec("synthetic:100:8:3").unwrap();
    assert_eq!((train.len(), eval.len(), train.input_dim(), train.num_classes()), (100, 20, 8, 3));
    let (train, eval) = datasets::from_spec("synthetic").unwrap();
    assert_eq!(
        (train.len(), eval.len(), train.input_dim(), train.num_classes()),
        (10_000, 2000, 64, 10)
    );
    for (spec, needle) in [
        ("imagenet", "unknown dataset"),
        ("mnist:", "directory"),
        ("synthetic:0", "N must be a positive integer"),
        ("synthetic:10:x", "DIM"),
        ("synthetic:1:2:3:4", "at most 3"),
    ] {
        let e = datasets::from_spec(spec).unwrap_err().to_string();
        assert!(e.contains(needle) && e.contains(spec), "{spec}: {e}");
    }
    // The message lists every form a spec can take.
    let e = datasets::from_spec("synthetic:abc").unwrap_err().to_string();
    for form in ["digits", "mnist:DIR", "cifar10:DIR", "synthetic-cifar[:N]", "synthetic[:N[:DIM"] {
        assert!(e.contains(form), "{form} missing from: {e}");
    }
}

/// A CIFAR-10 binary batch of `labels.len()` records; record `r`'s pixel `p` is `(r*7 + p) % 256`.
fn cifar_batch(labels: &[u8], salt: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for (r, &l) in labels.iter().enumerate() {
        out.push(l);
        out.extend((0..3072).map(|p| ((r * 7 + p + salt) % 256) as u8));
    }
    out
}

fn write_cifar(dir: &Path) {
    for i in 1..=5 {
        std::fs::write(dir.join(format!("data_batch_{i}.bin")), cifar_batch(&[i as u8, 9], i))
            .unwrap();
    }
    std::fs::write(dir.join("test_batch.bin"), cifar_batch(&[3], 100)).unwrap();
}

#[test]
fn cifar10_reads_the_five_train_batches_in_order_and_the_test_batch() {
    let tmp = tempfile::tempdir().unwrap();
    write_cifar(tmp.path());
    let (train, eval) = tandem_data::datasets::cifar10(tmp.path()).unwrap();
    assert_eq!((train.len(), eval.len()), (10, 1));
    assert_eq!((train.input_dim(), train.num_classes()), (3072, 10));
    assert_eq!(train.labels(), &[1, 9, 2, 9, 3, 9, 4, 9, 5, 9]);
    assert_eq!(eval.labels(), &[3]);
    // Record 1 of data_batch_3 (the 6th example), channel 2 (blue), row 0, column 5: CHW,
    // pixel byte / 255.
    let row = train.row(5).unwrap();
    let p = 2 * 1024 + 5;
    assert_eq!(row[p], ((7 + p + 3) % 256) as f32 / 255.0);
    assert!(row.iter().all(|&x| (0.0..=1.0).contains(&x)));
    // The archive's own layout (`cifar-10-batches-bin/`) is found too, and the spec works.
    let outer = tempfile::tempdir().unwrap();
    let nested = outer.path().join("cifar-10-batches-bin");
    std::fs::create_dir(&nested).unwrap();
    write_cifar(&nested);
    let spec = format!("cifar10:{}", outer.path().display());
    let (t2, e2) = tandem_data::datasets::from_spec(&spec).unwrap();
    assert_eq!((t2, e2), (train, eval));
}

#[test]
fn cifar10_errors_name_the_file_and_the_record() {
    let tmp = tempfile::tempdir().unwrap();
    let err = |dir: &Path| tandem_data::datasets::cifar10(dir).unwrap_err().to_string();
    write_cifar(tmp.path());
    std::fs::remove_file(tmp.path().join("data_batch_4.bin")).unwrap();
    let e = err(tmp.path());
    assert!(e.contains("data_batch_4.bin"), "{e}");

    write_cifar(tmp.path());
    let mut truncated = cifar_batch(&[1, 2], 0);
    truncated.truncate(3073 + 100);
    std::fs::write(tmp.path().join("data_batch_2.bin"), truncated).unwrap();
    let e = err(tmp.path());
    assert!(e.contains("data_batch_2.bin") && e.contains("3173 bytes"), "{e}");

    write_cifar(tmp.path());
    std::fs::write(tmp.path().join("test_batch.bin"), cifar_batch(&[4, 0, 57], 0)).unwrap();
    let e = err(tmp.path());
    assert!(e.contains("test_batch.bin") && e.contains("record 2: label 57"), "{e}");

    let e = tandem_data::datasets::from_spec("cifar10:").unwrap_err().to_string();
    assert!(e.contains("needs a directory"), "{e}");
}

#[test]
fn synthetic_cifar_is_deterministic_and_cifar_shaped() {
    let (a, ae) = tandem_data::datasets::from_spec("synthetic-cifar:50").unwrap();
    let (b, _) = tandem_data::datasets::synthetic_cifar(50, 0).unwrap();
    assert_eq!(a, b);
    assert_eq!((a.len(), ae.len(), a.input_dim(), a.num_classes()), (50, 10, 3072, 10));
    let (c, _) = tandem_data::datasets::synthetic_cifar(50, 1).unwrap();
    assert_ne!(a, c, "another seed, other data");
    assert!(tandem_data::datasets::from_spec("synthetic-cifar:0").is_err());
}
