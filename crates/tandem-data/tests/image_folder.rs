//! A folder of identities (`DIR/IDENTITY/IMAGE`): listed as torchvision's ImageFolder lists it,
//! trained on directly (`--data folder:DIR`) or packed as mxnet's im2rec packs it, the two
//! giving the same examples; files that are not images, that do not decode or are not 112x112
//! are skipped and counted by both, before any training (or, strictly, refused by name), never
//! a crash.
use std::path::Path;

use tandem_data::datasets::faces::{write_synthetic_faces, FaceFormat, FaceRecDataset};
use tandem_data::datasets::image_folder::{pack, ImageFolder};
use tandem_data::recordio::{IndexedRecordReader, IrHeader};
use tandem_data::Dataset;

/// The synthetic set's images as a folder: `id_CC/img_KKKKK.jpg` (JPEG bytes as stored), plus a
/// text file that is not an image.
fn folder_from_synthetic(root: &Path) -> FaceRecDataset {
    let rec_dir = root.join("rec");
    write_synthetic_faces(&rec_dir, 4, 3, 112, FaceFormat::Jpeg, 2).unwrap();
    let rec = FaceRecDataset::open(&rec_dir).unwrap();
    let reader =
        IndexedRecordReader::open(&rec_dir.join("train.idx"), &rec_dir.join("train.rec")).unwrap();
    for i in 0..rec.len() {
        let key = rec.key(i).unwrap();
        let record = reader.read(key).unwrap();
        let (h, payload) = IrHeader::unpack(&record).unwrap();
        let dir = root.join("faces").join(format!("id_{:02}", h.label as usize));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("img_{key:05}.jpg")), payload).unwrap();
    }
    std::fs::write(root.join("faces/id_00/notes.txt"), "not an image").unwrap();
    rec
}

#[test]
fn a_folder_trains_as_its_packed_rec_and_as_the_synthetic_set() {
    let d = tempfile::tempdir().unwrap();
    let rec = folder_from_synthetic(d.path());
    let faces = d.path().join("faces");
    let listed = ImageFolder::list(&faces).unwrap();
    assert_eq!(listed.classes, ["id_00", "id_01", "id_02", "id_03"]);
    assert_eq!(listed.samples.len(), 12);
    assert_eq!(listed.not_images.len(), 1, "notes.txt");
    let (folder, skipped) = FaceRecDataset::open_folder(&faces).unwrap();
    assert_eq!((folder.len(), folder.num_classes(), skipped.len()), (12, 4, 0));
    let out = d.path().join("packed");
    let mut calls = 0;
    let report = pack(&listed, &out, 112, false, &mut |done, total| {
        calls += 1;
        assert_eq!((done, total), (calls, 12));
    })
    .unwrap();
    assert_eq!((report.images, report.classes, report.not_images), (12, 4, 1));
    assert!(report.skipped.is_empty());
    let packed = FaceRecDataset::open(&out).unwrap();
    assert_eq!((packed.len(), packed.num_classes()), (12, 4));
    for i in 0..12 {
        let (a, b, c) = (rec.get(i).unwrap(), folder.get(i).unwrap(), packed.get(i).unwrap());
        assert_eq!((a.label, b.label, c.label), (a.label, a.label, a.label), "image {i}");
        assert!(a.features == b.features && a.features == c.features, "image {i}: pixels");
    }
    // im2rec's records: flag 0, the class as the label, the index as the id; its .lst.
    let reader = IndexedRecordReader::open(&out.join("train.idx"), &out.join("train.rec")).unwrap();
    let (h, _) = IrHeader::unpack(&reader.read(5).unwrap()).unwrap();
    assert_eq!((h.labels.len(), h.label, h.id, h.id2), (0, 1.0, 5, 0), "flag 0: one scalar label");
    let lst = std::fs::read_to_string(out.join("train.lst")).unwrap();
    assert_eq!(lst.lines().nth(5), Some("5\t1.000000\tid_01/img_00006.jpg"));
}

#[test]
fn bad_images_are_skipped_and_counted_or_refused_by_name() {
    let d = tempfile::tempdir().unwrap();
    folder_from_synthetic(d.path());
    let faces = d.path().join("faces");
    std::fs::write(faces.join("id_01/broken.jpg"), b"\xff\xd8 not really a jpeg").unwrap();
    let small = image::RgbImage::new(64, 64);
    small.save(faces.join("id_02/small.png")).unwrap();
    let listed = ImageFolder::list(&faces).unwrap();
    let out = d.path().join("packed");
    let report = pack(&listed, &out, 112, false, &mut |_, _| {}).unwrap();
    assert_eq!(report.images, 12);
    let skipped: Vec<String> =
        report.skipped.iter().map(|(p, why)| format!("{}: {why}", p.display())).collect();
    assert_eq!(skipped.len(), 2, "{skipped:?}");
    assert!(skipped[0].contains("broken.jpg") && skipped[0].contains("decode"), "{skipped:?}");
    assert!(skipped[1].contains("small.png") && skipped[1].contains("64x64"), "{skipped:?}");
    // Strict: the first bad image ends it, naming the file, and nothing is left behind.
    let strict = d.path().join("strict");
    let e = pack(&listed, &strict, 112, true, &mut |_, _| {}).unwrap_err().to_string();
    assert!(e.contains("broken.jpg"), "{e}");
    assert!(!strict.join("train.rec").exists() && !strict.join("train.idx").exists());
    // Training straight from the folder applies the same rule before the first step: the same
    // images left out, with the same reasons, and every example it keeps reads (the packed
    // set's, in the same order).
    let (folder, left_out) = FaceRecDataset::open_folder(&faces).unwrap();
    let left_out: Vec<String> =
        left_out.iter().map(|(p, why)| format!("{}: {why}", p.display())).collect();
    assert_eq!(left_out, skipped);
    let packed = FaceRecDataset::open(&out).unwrap();
    assert_eq!(folder.len(), report.images);
    for i in 0..folder.len() {
        let (a, b) = (folder.get(i).unwrap(), packed.get(i).unwrap());
        assert!(a.label == b.label && a.features == b.features, "example {i}");
    }
}

#[test]
fn unusable_folders_are_named() {
    let d = tempfile::tempdir().unwrap();
    let e = ImageFolder::list(d.path()).unwrap_err().to_string();
    assert!(e.contains("no class folders"), "{e}");
    std::fs::create_dir_all(d.path().join("alice")).unwrap();
    std::fs::write(d.path().join("alice/readme.md"), "x").unwrap();
    let e = ImageFolder::list(d.path()).unwrap_err().to_string();
    assert!(e.contains("alice") && e.contains("no JPEG or PNG"), "{e}");
    std::fs::write(d.path().join("alice/face.webp"), "x").unwrap();
    let e = ImageFolder::list(d.path()).unwrap_err().to_string();
    assert!(e.contains("face.webp") && e.contains("JPEG or PNG"), "{e}");
    let e = FaceRecDataset::open_folder(&d.path().join("missing")).err().unwrap().to_string();
    assert!(e.contains("missing"), "{e}");
    // A folder of nothing but unusable images is refused, naming it.
    std::fs::remove_file(d.path().join("alice/face.webp")).unwrap();
    std::fs::write(d.path().join("alice/face.jpg"), "not a jpeg").unwrap();
    let e = FaceRecDataset::open_folder(d.path()).err().unwrap().to_string();
    assert!(e.contains("no usable image"), "{e}");
}
