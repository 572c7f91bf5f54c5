//! The face recipe's checkpoints from before the one checkpoint API (`tandem-partial-fc-1`)
//! read through tandem-train's reader once the recipe registers the format, and are refused by
//! name before.
use tandem_ckpt::Value;
use tandem_recipes::face::{register_checkpoint_formats, FACE_FORMAT};
use tandem_testutil::row_fixture::{rows, share, weights, CLASSES};
use tandem_train::checkpoint::{Checkpointer, Saved, MANIFEST};

/// The face recipe's checkpoints from before this API (`tandem-partial-fc-1`) read through
/// the same reader: its head files as a `head` row shard and a `buffers` rank shard.
#[test]
fn the_face_recipes_earlier_format_reads_as_a_sharded_checkpoint() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("step-00000006");
    std::fs::create_dir_all(&dir).unwrap();
    let mut heads = Vec::new();
    for rank in 0..2 {
        let (start, len) = share(rank, 2);
        let r = rows(start, len, 0.25);
        let file = format!("head-rank-{rank:05}-of-00002.pt");
        let head = Value::dict_from([
            ("rank", Value::Int(rank as i64)),
            ("start", Value::Int(start as i64)),
            ("len", Value::Int(len as i64)),
            ("weight", r.get("weight").unwrap().clone()),
            ("state", r.get("state").unwrap().clone()),
            ("buffers", Value::dict_from([("bn.running_mean", Value::Int(rank as i64))])),
        ]);
        tandem_ckpt::save(dir.join(&file), &head).unwrap();
        heads.push(serde_json::json!({"file": file, "start": start, "len": len}));
    }
    let replicated = Value::dict_from([
        ("format", Value::Str("tandem-partial-fc-1".into())),
        ("global_step", Value::Int(6)),
    ]);
    tandem_ckpt::save(dir.join("replicated.pt"), &replicated).unwrap();
    let manifest = serde_json::json!({
        "format": "tandem-partial-fc-1", "world_size": 2, "global_step": 6, "epoch": 1,
        "num_classes": CLASSES, "embedding_size": 2, "replicated": "replicated.pt", "heads": heads,
    });
    std::fs::write(dir.join(MANIFEST), serde_json::to_vec(&manifest).unwrap()).unwrap();
    // Unregistered, the format is refused by name (tandem-train knows no face recipe).
    let e = Saved::open(&dir).unwrap_err().to_string();
    assert!(e.contains("manifest.json") && e.contains("format `tandem-partial-fc-1`"), "{e}");
    register_checkpoint_formats();
    let saved = Checkpointer::new(root.path(), 2).latest().unwrap().unwrap();
    assert_eq!((saved.format(), saved.global_step(), saved.epoch()), (FACE_FORMAT, 6, 1));
    let r = saved.read_rows("head", 1..5).unwrap();
    assert_eq!(weights(&r), [10.25, 11.25, 20.25, 21.25, 30.25, 31.25, 40.25, 41.25]);
    assert_eq!(r.get("state").unwrap().get("exp_avg").unwrap().as_tensor().unwrap().shape, [4, 2]);
    let bn = saved.read_rank("buffers", 1).unwrap().unwrap();
    assert_eq!(bn.get("bn.running_mean"), Some(&Value::Int(1)));
    // A manifest naming a file outside the directory is refused, naming the manifest.
    let bad = serde_json::json!({
        "format": "tandem-partial-fc-1", "world_size": 1, "global_step": 6, "epoch": 1,
        "num_classes": CLASSES, "embedding_size": 2, "replicated": "replicated.pt",
        "heads": [{"file": "../../etc/passwd", "start": 0, "len": CLASSES}],
    });
    std::fs::write(dir.join(MANIFEST), serde_json::to_vec(&bad).unwrap()).unwrap();
    let e = Saved::open(&dir).unwrap_err().to_string();
    assert!(e.contains("manifest.json") && e.contains("not a plain name"), "{e}");
}
