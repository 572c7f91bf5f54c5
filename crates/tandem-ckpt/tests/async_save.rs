//! `AsyncCheckpointManager`: saves written in the background with the synchronous guarantees
//! (atomic file, `latest`, keep-last), at most one in flight, failures returned at the next save
//! or at `wait`, naming the file.
use tandem_ckpt::{AsyncCheckpointManager, CheckpointManager, LoadOptions, TensorData, Value};

fn value(step: i64, len: usize) -> Value {
    let data: Vec<f32> = (0..len).map(|i| step as f32 + i as f32 * 1e-3).collect();
    Value::dict_from([
        ("global_step", Value::Int(step)),
        ("model", Value::dict_from([("w", Value::Tensor(TensorData::from_f32(&[len], &data)))])),
    ])
}

fn step_of(path: &std::path::Path) -> i64 {
    let opts = LoadOptions { verify_checksums: true, ..Default::default() };
    let v = tandem_ckpt::load_with(path, &opts).unwrap();
    let step = v.get("global_step").and_then(|s| s.as_int()).unwrap();
    let got = v.get("model").and_then(|m| m.get("w")).and_then(|t| t.as_tensor()).unwrap();
    let want = value(step, got.shape[0]);
    let want = want.get("model").and_then(|m| m.get("w")).and_then(|t| t.as_tensor()).unwrap();
    assert!(got.contiguous_bytes() == want.contiguous_bytes(), "{}", path.display());
    step
}

#[test]
fn background_saves_keep_the_atomic_latest_and_keep_last_guarantees() {
    let dir = tempfile::tempdir().unwrap();
    let mut saver = AsyncCheckpointManager::new(CheckpointManager::new(dir.path(), 2));
    let mut paths = Vec::new();
    for step in 1..=5 {
        paths.push(saver.save(&format!("step-{step:02}"), value(step, 1000)).unwrap());
    }
    assert_eq!(saver.wait().unwrap(), Some(paths[4].clone()));
    assert_eq!(saver.wait().unwrap(), None, "nothing left in flight");
    let listed = saver.manager().list().unwrap();
    assert_eq!(listed.len(), 2, "keep_last 2: {listed:?}");
    let latest = std::fs::read_to_string(dir.path().join("latest")).unwrap();
    assert_eq!(latest.trim(), "checkpoint-step-05.pt");
    let (picked, _) = saver.manager().latest_valid().unwrap().unwrap();
    assert_eq!(step_of(&picked), 5);
    assert!(!std::fs::read_dir(dir.path())
        .unwrap()
        .any(|e| { e.unwrap().file_name().to_string_lossy().ends_with(".tmp") }));
}

#[test]
fn a_new_save_waits_for_the_one_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let mut saver = AsyncCheckpointManager::new(CheckpointManager::new(dir.path(), 0));
    // 32 MiB: long enough that it is still being written when the next save is called.
    let first = saver.save("a", value(1, 8 << 20)).unwrap();
    saver.save("b", value(2, 10)).unwrap();
    // Returning from the second save means the first is complete on disk, nothing half-written.
    assert_eq!(step_of(&first), 1);
    saver.wait().unwrap();
    assert_eq!(step_of(&saver.manager().path_for("b")), 2);
}

#[test]
fn dropping_the_manager_finishes_the_save_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let path = {
        let mut saver = AsyncCheckpointManager::new(CheckpointManager::new(dir.path(), 0));
        saver.save("last", value(7, 4 << 20)).unwrap()
    };
    assert_eq!(step_of(&path), 7);
}

#[test]
fn a_failed_write_surfaces_at_the_next_save_and_at_wait_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    // The checkpoint directory's parent is a regular file: every write fails.
    let blocker = dir.path().join("not-a-dir");
    std::fs::write(&blocker, b"x").unwrap();
    let ck_dir = blocker.join("ckpt");
    let mut saver = AsyncCheckpointManager::new(CheckpointManager::new(&ck_dir, 3));
    saver.save("step-1", value(1, 10)).expect("the save starts; the failure comes later");
    let e = saver.save("step-2", value(2, 10)).unwrap_err().to_string();
    assert!(e.contains("not-a-dir"), "the error names the path: {e}");
    assert!(!saver.in_flight(), "a save after a failed one does not start");
    assert_eq!(saver.wait().unwrap(), None, "the failure was reported once");

    saver.save("step-3", value(3, 10)).unwrap();
    let e = saver.wait().unwrap_err().to_string();
    assert!(e.contains("not-a-dir"), "{e}");

    let e = saver.save("../escape", value(4, 10)).unwrap_err().to_string();
    assert!(e.contains("checkpoint name `../escape`"), "a bad name fails at once: {e}");
}
