//! Verification over ranks whose shares of a set differ: every rank runs as many forwards (a
//! sharded model's forwards are collectives, so a rank that stopped early would leave the
//! others waiting), and the result is the one rank's alone, number for number.
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{Device, Tensor, D};
use tandem_data::datasets::faces::{write_synthetic_faces, FaceFormat};
use tandem_recipes::face_eval::verification::{self, ValResult};
use tandem_testutil::run_tcp_world;

/// A deterministic stand-in for a backbone: each image's embedding is its mean per channel
/// band (3 channels x 4 bands of rows), the same on every rank.
fn embed(x: &Tensor) -> candle_core::Result<Tensor> {
    let n = x.dim(0)?;
    x.reshape((n, 12, 112 * 112 / 4))?.mean(D::Minus1)
}

/// (forwards run, results) of a verification of `dir`'s pairs on `world` ranks.
fn verify(dir: &std::path::Path, world: usize) -> Vec<(usize, Vec<ValResult>)> {
    let path = dir.join("pairs.bin");
    run_tcp_world(world, move |pg| {
        let sets = verification::load(std::slice::from_ref(&path)).unwrap();
        let forwards = AtomicUsize::new(0);
        let counted = |x: &Tensor| {
            forwards.fetch_add(1, Ordering::Relaxed);
            embed(x)
        };
        let results = verification::evaluate_with(&counted, &[], &sets, &Device::Cpu, &pg).unwrap();
        (forwards.load(Ordering::Relaxed), results)
    })
}

#[test]
fn ranks_with_short_shares_run_as_many_forwards_and_the_result_is_one_ranks() {
    let dir = tempfile::tempdir().unwrap();
    // 50 pairs: 100 images; over 3 ranks shares of 34, 34 and 32 images, two batches of 32
    // each — the last rank's second batch is empty.
    write_synthetic_faces(dir.path(), 4, 30, 112, FaceFormat::Png, 50).unwrap();
    let alone = verify(dir.path(), 1);
    let (one_forwards, want) = &alone[0];
    assert_eq!(*one_forwards, 2 * 4, "one rank: 4 batches of plain and mirrored images");
    assert!(
        want[0].accuracy > 0.0 && want[0].figure(verification::XNORM).unwrap() > 0.0,
        "{want:?}"
    );
    let out = verify(dir.path(), 3);
    for (rank, (forwards, got)) in out.iter().enumerate() {
        assert_eq!(*forwards, 2 * 2, "rank {rank}: 2 batches, plain and mirrored");
        assert_eq!(got, want, "rank {rank}: the result of 3 ranks is the one rank's");
    }
}
