//! The one checkpoint API (`tandem_train::checkpoint`) on real process groups (ranks as
//! threads over loopback TCP): single-file and sharded saves, retention that never costs the
//! last good checkpoint, background saves whose failures reach every rank, reads of only the
//! slices a rank owns on another world size, and a registered earlier directory format
//! refused by name when it is not registered (the face recipe's own: tandem-recipes' tests).
//! (A save that hits a full disk, and the resume after it: tests/face_recipe.rs and
//! tests/reliability.rs in tandem-cli.)
use std::path::{Path, PathBuf};

use tandem_checkpoint::{Checkpointer, Saved, ShardDict, TrainingStateDict, LATEST, MANIFEST};
use tandem_ckpt::{TensorData, Value};
use tandem_testutil::row_fixture::{rows, share, weights, CLASSES};

/// This rank's sharded state at `step`: rows, entries {r, r + 10} and its own value.
fn sharded_state(rank: usize, world: usize, step: u64, fill: f32) -> TrainingStateDict {
    let (start, len) = share(rank, world);
    let entries = Value::Dict(
        [rank, rank + 10]
            .iter()
            .map(|&i| (Value::Int(i as i64), Value::Int(100 * i as i64 + step as i64)))
            .collect(),
    );
    let replicated = if rank == 0 {
        Value::dict_from([("global_step", Value::Int(step as i64)), ("model", Value::new_dict())])
    } else {
        Value::None
    };
    TrainingStateDict::new(step, 0, replicated)
        .shard(ShardDict::rows("head", start, len, CLASSES, rows(start, len, fill)))
        .shard(ShardDict::entries("optimizer/state", vec![rank, rank + 10], entries))
        .shard(ShardDict::rank("buffers", Value::Int(rank as i64)))
}

/// Saves `saves` (step, fill) in order on a fresh world of `world` with `keep_last`.
fn save_all(
    dir: &Path,
    world: usize,
    keep_last: usize,
    background: bool,
    saves: &'static [(u64, f32)],
) {
    let dir = dir.to_path_buf();
    tandem_testutil::run_tcp_world(world, move |pg| {
        let mut ck = Checkpointer::new(dir.clone(), keep_last).background(background);
        for &(step, fill) in saves {
            let state = sharded_state(pg.rank(), pg.size(), step, fill);
            ck.save(&pg, &format!("step-{step:08}"), state).unwrap();
        }
        ck.settle(&pg).unwrap();
    });
}

fn names(dir: &Path) -> Vec<String> {
    let mut n: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != LATEST)
        .collect();
    n.sort();
    n
}

#[test]
fn a_sharded_save_reads_back_on_another_world_size_from_only_the_files_it_needs() {
    let root = tempfile::tempdir().unwrap();
    for background in [false, true] {
        let dir = root.path().join(format!("bg-{background}"));
        save_all(&dir, 2, 2, background, &[(4, 0.5)]);
        let saved = Checkpointer::new(&dir, 2).latest().unwrap().expect("a checkpoint");
        assert_eq!((saved.global_step(), saved.world_size()), (4, 2));
        assert_eq!(saved.shard_names(), ["head", "optimizer/state", "buffers"]);
        assert_eq!(saved.rows_total("head"), Some(CLASSES));
        // Saved as 3 + 2 rows; read as 3 ranks would (2 + 2 + 1): rows 2..4 straddle both.
        let middle = saved.read_rows("head", 2..4).unwrap();
        assert_eq!(weights(&middle), [20.5, 21.5, 30.5, 31.5], "background {background}");
        let moment = middle.get("state").unwrap().get("exp_avg").unwrap().as_tensor().unwrap();
        assert_eq!(moment.to_f32_vec(), [-20.5, -21.5, -30.5, -31.5]);
        let step = middle.get("state").unwrap().get("step").unwrap().as_tensor().unwrap();
        assert_eq!(step.to_f32_vec(), [7.0]);
        assert_eq!(saved.read_rank("buffers", 1).unwrap(), Some(Value::Int(1)));
        assert_eq!(saved.read_rank("buffers", 2).unwrap(), None, "no rank 2 in a world of 2");
        let entries = saved.read_entries("optimizer/state", Some(&[0, 11])).unwrap();
        assert_eq!(
            entries,
            Value::Dict(vec![(Value::Int(0), Value::Int(4)), (Value::Int(11), Value::Int(1104))])
        );
        let whole = saved.consolidated().unwrap();
        assert_eq!(whole.get("global_step"), Some(&Value::Int(4)));
        assert_eq!(weights(whole.get("head").unwrap()).len(), CLASSES * 2);
        let all = whole.get("optimizer").unwrap().get("state").unwrap().as_dict().unwrap().len();
        assert_eq!(all, 4, "entries 0, 1, 10, 11 put back under optimizer/state");
        // Rows 0..3 live in rank 0's file alone: with rank 1's file gone they still read, and
        // asking for rank 1's rows names the file.
        std::fs::remove_file(saved.path().join("rank-00001-of-00002.pt")).unwrap();
        assert_eq!(weights(&saved.read_rows("head", 0..3).unwrap())[..2], [0.5, 1.5]);
        let e = saved.read_rows("head", 3..5).unwrap_err().to_string();
        assert!(e.contains("rank-00001-of-00002.pt"), "{e}");
    }
}

#[test]
fn keep_last_1_re_saving_an_existing_step_swaps_the_new_copy_in() {
    let root = tempfile::tempdir().unwrap();
    save_all(root.path(), 2, 1, false, &[(8, 1.0), (8, 2.0)]);
    assert_eq!(names(root.path()), ["step-00000008"], "one complete checkpoint, no .new/.old");
    let saved = Saved::open(&root.path().join("step-00000008")).unwrap();
    assert_eq!(
        weights(&saved.read_rows("head", 0..CLASSES).unwrap())[0],
        2.0,
        "the re-save's contents"
    );
    let latest = std::fs::read_to_string(root.path().join(LATEST)).unwrap();
    assert_eq!(latest.trim(), "step-00000008");
}

#[test]
fn a_swap_in_progress_is_never_counted_and_unfinished_saves_are_pruned() {
    let root = tempfile::tempdir().unwrap();
    save_all(root.path(), 2, 2, false, &[(1, 1.0)]);
    // Leftovers of an interrupted swap at step 2 and of crashed saves at steps 3 and 9 (no
    // manifest).
    for leftover in ["step-00000002.new", "step-00000002.old", "step-00000003", "step-00000009"] {
        std::fs::create_dir_all(root.path().join(leftover)).unwrap();
    }
    std::thread::sleep(std::time::Duration::from_millis(20));
    save_all(root.path(), 2, 2, false, &[(4, 4.0)]);
    // keep-last 2 keeps both complete checkpoints (1 and 4): the .new/.old took no place; the
    // unfinished saves from before the new one are gone.
    assert_eq!(
        names(root.path()),
        ["step-00000001", "step-00000002.new", "step-00000002.old", "step-00000004"]
    );
    let saved = Checkpointer::new(root.path(), 2).latest().unwrap().unwrap();
    assert_eq!(
        (saved.path(), saved.global_step()),
        (root.path().join("step-00000004").as_path(), 4)
    );
}

#[test]
fn pruning_keeps_exactly_the_newest_complete_checkpoints() {
    let root = tempfile::tempdir().unwrap();
    save_all(root.path(), 2, 2, true, &[(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]);
    assert_eq!(names(root.path()), ["step-00000003", "step-00000004"]);
}

/// A save without shards is one torch-loadable file rank 0 writes, with canonical keys.
fn file_state(step: u64) -> TrainingStateDict {
    let model = Value::dict_from([(
        "module.w",
        Value::Tensor(TensorData::from_f32(&[2], &[step as f32, 1.0])),
    )]);
    let value = Value::dict_from([("global_step", Value::Int(step as i64)), ("model", model)]);
    TrainingStateDict::new(step, 0, value)
}

fn save_files(dir: &Path, world: usize, keep_last: usize, steps: &'static [u64]) -> Vec<PathBuf> {
    let dir = dir.to_path_buf();
    tandem_testutil::run_tcp_world(world, move |pg| {
        let mut ck = Checkpointer::new(dir.clone(), keep_last);
        let mut paths = Vec::new();
        for &step in steps {
            paths.push(ck.save(&pg, &format!("s{step}"), file_state(step)).unwrap());
            std::thread::sleep(std::time::Duration::from_millis(15)); // distinct mtimes
        }
        paths
    })
    .remove(0)
}

#[test]
fn single_files_keep_last_n_move_latest_and_skip_corrupt_ones() {
    let root = tempfile::tempdir().unwrap();
    // Temp files of a killed write are removed; other files stay.
    std::fs::create_dir_all(root.path()).unwrap();
    let stale = root.path().join(".checkpoint-s0.pt.Ab12Cd.tmp");
    let foreign = root.path().join(".notes.txt.Qw34Er.tmp");
    std::fs::write(&stale, b"partial").unwrap();
    std::fs::write(&foreign, b"mine").unwrap();
    let paths = save_files(root.path(), 2, 3, &[1, 2, 3, 4]);
    assert!(!stale.exists() && foreign.exists());
    std::fs::remove_file(&foreign).unwrap();
    assert_eq!(names(root.path()), ["checkpoint-s2.pt", "checkpoint-s3.pt", "checkpoint-s4.pt"]);
    assert_eq!(
        std::fs::read_to_string(root.path().join(LATEST)).unwrap().trim(),
        "checkpoint-s4.pt"
    );
    let v = tandem_ckpt::load(&paths[3]).unwrap();
    assert!(v.get("model").unwrap().get("w").is_some(), "saved with canonical keys");
    // Newest: a flipped byte inside the tensor data; second newest: truncated. Resume takes s2.
    let mut b = std::fs::read(&paths[3]).unwrap();
    let i = b.windows(6).position(|w| w == b"data/0").unwrap() + 6;
    b[(i + 4 + 63) & !63] ^= 0xff;
    std::fs::write(&paths[3], &b).unwrap();
    let b = std::fs::read(&paths[2]).unwrap();
    std::fs::write(&paths[2], &b[..b.len() - 30]).unwrap();
    let saved = Checkpointer::new(root.path(), 3).latest().unwrap().unwrap();
    assert_eq!((saved.path(), saved.global_step()), (paths[1].as_path(), 2));
    // A stale `latest` pointer does not hide a newer checkpoint.
    std::fs::write(root.path().join(LATEST), "checkpoint-s1.pt\n").unwrap();
    assert_eq!(Checkpointer::new(root.path(), 3).latest().unwrap().unwrap().global_step(), 2);
    assert!(Checkpointer::new(root.path().join("none"), 3).latest().unwrap().is_none());
}

#[test]
fn a_failed_background_write_is_every_ranks_error_at_the_next_save_and_nothing_is_lost() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().to_path_buf();
    let errors = tandem_testutil::run_tcp_world(2, move |pg| {
        let mut ck = Checkpointer::new(dir.clone(), 1).background(true);
        ck.save(&pg, "step-00000001", sharded_state(pg.rank(), 2, 1, 1.0)).unwrap();
        ck.settle(&pg).unwrap();
        // Rank 1's file cannot be written: its value nests deeper than a file may hold.
        let mut state = sharded_state(pg.rank(), 2, 2, 2.0);
        if pg.rank() == 1 {
            let deep = (0..300).fold(Value::Int(0), |v, _| Value::List(vec![v]));
            state.shards[2].value = deep;
        }
        let started = ck.save(&pg, "step-00000002", state);
        assert!(started.is_ok(), "the failure comes at the commit, not the start");
        let e = ck
            .save(&pg, "step-00000003", sharded_state(pg.rank(), 2, 3, 3.0))
            .expect_err("the failed save is reported at the next save");
        assert!(!ck.in_flight());
        e.to_string()
    });
    assert!(errors[1].contains("rank-00001-of-00002.pt"), "rank 1 names its file: {}", errors[1]);
    assert!(errors[0].contains("another rank could not write"), "{}", errors[0]);
    // The checkpoint before it is intact and the one a resume reads; step 3 never started.
    let saved = Checkpointer::new(root.path(), 1).latest().unwrap().unwrap();
    assert_eq!(saved.global_step(), 1);
    assert!(!root.path().join("step-00000003").exists());
    assert!(!root.path().join("step-00000002").join(MANIFEST).exists());
}

#[test]
fn bad_plans_fail_on_every_rank_before_anything_is_written() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().to_path_buf();
    let errors = tandem_testutil::run_tcp_world(2, move |pg| {
        let mut ck = Checkpointer::new(dir.clone(), 1);
        // Both ranks claim rows 0..3 of 5: they do not tile the object.
        let state = TrainingStateDict::new(1, 0, Value::new_dict()).shard(ShardDict::rows(
            "head",
            0,
            3,
            CLASSES,
            rows(0, 3, 0.0),
        ));
        ck.save(&pg, "step-00000001", state).unwrap_err().to_string()
    });
    for e in &errors {
        assert!(e.contains("shard `head`") && e.contains("rows"), "{e}");
    }
    assert!(!root.path().join("step-00000001").join(MANIFEST).exists());
    // Names that would leave the directory or look like a swap are refused.
    let dir = root.path().to_path_buf();
    tandem_testutil::run_tcp_world(1, move |pg| {
        let mut ck = Checkpointer::new(dir.clone(), 1);
        for bad in ["../x", "a.new", ""] {
            let e = ck.save(&pg, bad, file_state(1)).unwrap_err().to_string();
            assert!(e.contains("checkpoint name"), "{bad}: {e}");
        }
    });
}
