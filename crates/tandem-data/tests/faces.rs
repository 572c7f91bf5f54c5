//! insightface's face data against files written by an independent Python writer
//! (tests/fixtures/faces/make_fixtures.py): RecordIO identity sets and records split at magic
//! words, `.bin` verification sets pickled by Python 3 and as Python 2 did, image decoding and
//! normalisation as arcface_torch's, and the 10-fold verification accuracy against numpy.
use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use tandem_data::datasets::faces::{
    verification_accuracy, write_synthetic_faces, FaceFormat, FaceRecDataset, VerificationSet,
};
use tandem_data::recordio::IndexedRecordReader;
use tandem_data::Dataset;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/faces")
}

fn expected() -> Json {
    serde_json::from_str(&std::fs::read_to_string(dir().join("expected.json")).unwrap()).unwrap()
}

#[test]
fn python_written_identity_set_reads_with_labels_classes_and_pixels() {
    let e = expected();
    let ds = FaceRecDataset::open(&dir().join("rec")).unwrap();
    assert_eq!(ds.len(), e["num_images"].as_u64().unwrap() as usize);
    assert_eq!(ds.num_classes(), e["num_classes"].as_u64().unwrap() as usize, "from record 0");
    assert_eq!(ds.input_dim(), 3 * 112 * 112);
    for (i, img) in e["images"].as_array().unwrap().iter().enumerate() {
        assert_eq!(ds.key(i), img["key"].as_u64(), "image records in key order");
        let ex = ds.get(i).unwrap();
        assert_eq!(ex.label, img["label"].as_i64().unwrap());
        // PNG decodes exactly; JPEG decoders may differ by a level or two.
        let tol = if img["format"] == "PNG" { 1e-6 } else { 4.0 / 127.5 };
        for s in img["samples"].as_array().unwrap() {
            let s: Vec<f64> = s.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
            let at = s[0] as usize * 112 * 112 + s[1] as usize * 112 + s[2] as usize;
            assert!(
                (ex.features[at] as f64 - s[3]).abs() <= tol,
                "image {i} at {s:?}: {}",
                ex.features[at]
            );
        }
        for (c, m) in img["channel_means"].as_array().unwrap().iter().enumerate() {
            let ours = ex.features[c * 112 * 112..(c + 1) * 112 * 112]
                .iter()
                .map(|&v| v as f64)
                .sum::<f64>()
                / (112.0 * 112.0);
            assert!((ours - m.as_f64().unwrap()).abs() < 2e-3, "image {i} channel {c} mean {ours}");
        }
    }
}

#[test]
fn records_split_at_magic_words_come_back_whole() {
    let e = expected();
    let r =
        IndexedRecordReader::open(&dir().join("magic/train.idx"), &dir().join("magic/train.rec"))
            .unwrap();
    for (k, hex) in e["magic_records"].as_array().unwrap().iter().enumerate() {
        let hex = hex.as_str().unwrap();
        let want: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        assert_eq!(r.read(k as u64).unwrap(), want, "record {k}");
    }
}

#[test]
fn verification_sets_load_from_python_3_and_python_2_pickles() {
    let e = expected();
    let ds = FaceRecDataset::open(&dir().join("rec")).unwrap();
    let issame: Vec<bool> =
        e["pairs"]["issame"].as_array().unwrap().iter().map(|v| v.as_bool().unwrap()).collect();
    let keys: Vec<u64> =
        e["pairs"]["image_keys"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    for file in ["pairs_py3.bin", "pairs_py2.bin"] {
        let set = VerificationSet::load(&dir().join(file)).unwrap();
        assert_eq!(set.issame, issame, "{file}");
        assert_eq!(set.pairs(), 4);
        for (i, key) in keys.iter().enumerate() {
            let [plain, flipped] = set.image(i, 112).unwrap();
            let index = (0..ds.len()).find(|&j| ds.key(j) == Some(*key)).unwrap();
            assert_eq!(plain, ds.get(index).unwrap().features, "{file} image {i} = record {key}");
            // The mirror: column x of one is column 111 - x of the other.
            assert_eq!(flipped[5 * 112 + 7], plain[5 * 112 + 104]);
        }
    }
    let bad = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(bad.path(), b"\x80\x02K\x05.").unwrap(); // the pickle of 5
    let err = VerificationSet::load(bad.path()).err().unwrap().to_string();
    assert!(err.contains(&bad.path().display().to_string()) && err.contains("int"), "{err}");
}

#[test]
fn verification_accuracy_matches_numpy() {
    for (n, case) in expected()["verification"].as_array().unwrap().iter().enumerate() {
        let emb: Vec<Vec<f32>> = case["embeddings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect())
            .collect();
        let same: Vec<bool> =
            case["issame"].as_array().unwrap().iter().map(|v| v.as_bool().unwrap()).collect();
        let (acc, std) = verification_accuracy(&emb, &same, 10).unwrap();
        assert!((acc - case["accuracy"].as_f64().unwrap()).abs() < 1e-9, "case {n}: {acc}");
        assert!((std - case["std"].as_f64().unwrap()).abs() < 1e-9, "case {n}: std {std}");
    }
    assert!(verification_accuracy(&[vec![1.0]], &[true], 10).is_err());
}

#[test]
fn synthetic_faces_are_an_insightface_set_in_both_encodings() {
    for format in [FaceFormat::Png, FaceFormat::Jpeg] {
        let d = tempfile::tempdir().unwrap();
        let w = write_synthetic_faces(d.path(), 5, 3, 112, format, 8).unwrap();
        assert_eq!((w.images, w.classes, w.pairs), (15, 5, 8));
        let ds = FaceRecDataset::open(d.path()).unwrap();
        assert_eq!((ds.len(), ds.num_classes()), (15, 5));
        let labels: Vec<i64> = (0..15).map(|i| ds.get(i).unwrap().label).collect();
        assert_eq!(labels, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]);
        let set = VerificationSet::load(&d.path().join("pairs.bin")).unwrap();
        assert_eq!(set.pairs(), 8);
        assert_eq!(set.issame.iter().filter(|&&s| s).count(), 4);
        set.image(15, 112).unwrap();
    }
}

#[test]
fn flips_depend_on_seed_epoch_and_index_only() {
    let d = tempfile::tempdir().unwrap();
    write_synthetic_faces(d.path(), 2, 8, 112, FaceFormat::Png, 2).unwrap();
    let plain = FaceRecDataset::open(d.path()).unwrap();
    let flipped = FaceRecDataset::open(d.path()).unwrap().with_flip(7);
    let again = FaceRecDataset::open(d.path()).unwrap().with_flip(7);
    let mut flips = Vec::new();
    for epoch in 0..3 {
        flipped.set_epoch(epoch);
        again.set_epoch(epoch);
        for i in 0..16 {
            let (a, b) = (flipped.get(i).unwrap().features, again.get(i).unwrap().features);
            assert_eq!(a, b, "same seed, epoch and index: same image");
            flips.push(a != plain.get(i).unwrap().features);
        }
    }
    let n = flips.iter().filter(|&&f| f).count();
    assert!((12..=36).contains(&n), "about half of 48 draws flip, got {n}");
}

#[test]
fn a_damaged_image_names_the_file_and_record() {
    let d = tempfile::tempdir().unwrap();
    write_synthetic_faces(d.path(), 2, 1, 112, FaceFormat::Png, 2).unwrap();
    let rec = d.path().join("train.rec");
    let mut bytes = std::fs::read(&rec).unwrap();
    // The first record's image starts after the 8-byte record head and the 24-byte IRHeader.
    bytes[8 + 24 + 20..8 + 24 + 60].fill(0);
    std::fs::write(&rec, bytes).unwrap();
    let ds = FaceRecDataset::open(d.path()).unwrap();
    let e = ds.get(0).unwrap_err().to_string();
    assert!(e.contains("train.rec") && e.contains("record 1") && e.contains("decode"), "{e}");
}

/// A header (record 0) is checked against the index before anything is sized by it: claims of
/// 1e12 images or identities are errors naming the file and record 0, not 8 TB allocations.
#[test]
fn a_header_claiming_more_than_the_index_holds_is_refused() {
    use tandem_data::recordio::{IndexedRecordWriter, IrHeader};
    for labels in [vec![1e12f32, 1e12], vec![3.0, 1e12], vec![2.5, 4.0], vec![f32::NAN, 3.0]] {
        let d = tempfile::tempdir().unwrap();
        let mut w =
            IndexedRecordWriter::create(&d.path().join("train.idx"), &d.path().join("train.rec"))
                .unwrap();
        w.write(0, &IrHeader::vector(labels.clone(), 0).pack(&[])).unwrap();
        for k in 1..3 {
            w.write(k, &IrHeader::scalar(0.0, k).pack(&[])).unwrap();
        }
        w.finish().unwrap();
        let started = std::time::Instant::now();
        let e = FaceRecDataset::open(d.path()).err().expect("refused").to_string();
        assert!(started.elapsed() < std::time::Duration::from_secs(1), "{labels:?}");
        assert!(e.contains("train.rec") && e.contains("record 0"), "{labels:?}: {e}");
    }
}

/// Verification sets as insightface's current tools write them (numpy arrays, pickled by real
/// numpy 2 at protocols 2, 4 and 5, and with numpy 1's module names; see
/// fixtures/faces/make_numpy_pairs.py): read as data, the same images and flags as the bytes
/// form.
#[test]
fn verification_sets_of_numpy_arrays_load_as_the_bytes_form_does() {
    let reference = VerificationSet::load(&dir().join("pairs_py3.bin")).unwrap();
    for file in [
        "pairs_numpy2_p2.bin",
        "pairs_numpy2_p5.bin",
        "pairs_numpy2_scalars_p4.bin",
        "pairs_numpy1_p2.bin",
        "pairs_numpy1_p5.bin",
    ] {
        let set =
            VerificationSet::load(&dir().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(set.issame, reference.issame, "{file}");
        assert_eq!(set.images, reference.images, "{file}");
    }
    // Code is still never run: a pickle calling anything else in numpy is refused by name.
    let bad = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(bad.path(), b"\x80\x02cnumpy\nload\nq\x00.").unwrap();
    let err = VerificationSet::load(bad.path()).err().unwrap().to_string();
    assert!(err.contains("numpy.load"), "{err}");
}
