//! Retention of the face recipe's per-rank checkpoints never costs the last good one: pruning
//! happens only after the new checkpoint is complete and in place, and only of complete
//! checkpoints; a re-save at an existing step (`--keep-last 1`) swaps the new copy in;
//! `step-N.new`/`.old` (a swap in progress) never count as checkpoints. Two ranks, loopback.
//! (A save that hits a full disk and the resume after it: tests/face_recipe.rs in tandem-cli.)
use std::path::Path;

use tandem_ckpt::{TensorData, Value};
use tandem_train::face::checkpoint::{FaceCheckpoints, SaveInfo, MANIFEST};

const WORLD: usize = 2;

fn info(rank: usize, step: u64) -> SaveInfo {
    SaveInfo { rank, world: WORLD, global_step: step, epoch: 0, num_classes: 4, embedding_size: 2 }
}

fn head(fill: f32) -> Value {
    Value::dict_from([
        ("weight", Value::Tensor(TensorData::from_f32(&[2, 2], &[fill; 4]))),
        ("state", Value::None),
        ("buffers", Value::None),
    ])
}

/// Saves `saves` (step, fill) in order on a fresh 2-rank world with `keep_last`.
fn save_all(dir: &Path, keep_last: usize, saves: &'static [(u64, f32)]) {
    let dir = dir.to_path_buf();
    tandem_testutil::run_tcp_world(WORLD, move |pg| {
        let mut ck = FaceCheckpoints::new(dir.clone(), keep_last);
        for &(step, fill) in saves {
            let replicated =
                (pg.rank() == 0).then(|| Value::dict_from([("step", Value::Int(step as i64))]));
            let name = format!("step-{step:08}");
            ck.save(&name, &info(pg.rank(), step), replicated, head(fill), &pg).unwrap();
        }
    });
}

fn names(dir: &Path) -> Vec<String> {
    let mut n: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    n.sort();
    n
}

fn head_fill(dir: &Path, rank: usize) -> f64 {
    let path = dir.join(format!("head-rank-{rank:05}-of-{WORLD:05}.pt"));
    let v = tandem_ckpt::load(&path).unwrap();
    v.get("weight").unwrap().as_tensor().unwrap().to_f64_vec()[0]
}

#[test]
fn keep_last_1_re_saving_an_existing_step_swaps_the_new_copy_in() {
    let root = tempfile::tempdir().unwrap();
    save_all(root.path(), 1, &[(8, 1.0), (8, 2.0)]);
    assert_eq!(names(root.path()), ["step-00000008"], "one complete checkpoint, no .new/.old");
    let ck = root.path().join("step-00000008");
    assert!(ck.join(MANIFEST).is_file());
    assert_eq!((head_fill(&ck, 0), head_fill(&ck, 1)), (2.0, 2.0), "the re-save's contents");
}

#[test]
fn a_swap_in_progress_is_never_counted_and_incomplete_saves_are_pruned() {
    let root = tempfile::tempdir().unwrap();
    save_all(root.path(), 2, &[(1, 1.0)]);
    // Leftovers of an interrupted swap at step 2 and of a crashed save at step 3 (no manifest),
    // and a newer incomplete save (step 9) from a run that crashed later.
    for leftover in ["step-00000002.new", "step-00000002.old", "step-00000003", "step-00000009"] {
        std::fs::create_dir_all(root.path().join(leftover)).unwrap();
    }
    save_all(root.path(), 2, &[(4, 4.0)]);
    let left = names(root.path());
    // keep-last 2 keeps both complete checkpoints (1 and 4): the .new/.old took no place; the
    // incomplete step 3 (older than the new one) is gone; step 9 is not this save's to judge.
    for kept in ["step-00000001", "step-00000004", "step-00000009"] {
        assert!(left.iter().any(|n| n == kept), "{kept} missing from {left:?}");
    }
    assert!(!left.iter().any(|n| n == "step-00000003"), "{left:?}");
    // A resume reads the newest complete one (step 9 has no manifest).
    let (latest, manifest) =
        FaceCheckpoints::new(root.path().to_path_buf(), 2).latest().unwrap().unwrap();
    assert_eq!((latest, manifest.global_step), (root.path().join("step-00000004"), 4));
}

#[test]
fn pruning_keeps_exactly_the_newest_complete_checkpoints() {
    let root = tempfile::tempdir().unwrap();
    save_all(root.path(), 2, &[(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]);
    assert_eq!(names(root.path()), ["step-00000003", "step-00000004"]);
}
