//! Every collective, every dtype, odd sizes (0, 1, 7, not divisible by the world), world sizes
//! 1-4, on both transports. Values are small integers so float sums are exact.
mod common;
use common::run_world;
use half::{bf16, f16};
use tandem_comm::{ProcessGroup, ReduceOp, TransportKind};

const SIZES: [usize; 6] = [0, 1, 7, 13, 1000, 4099];

fn val(rank: usize, i: usize) -> f64 {
    ((rank + 1) * (i % 5 + 1)) as f64
}

fn expected(n: usize, i: usize, op: ReduceOp) -> f64 {
    let vals: Vec<f64> = (0..n).map(|r| val(r, i)).collect();
    match op {
        ReduceOp::Sum => vals.iter().sum(),
        ReduceOp::Avg => vals.iter().sum::<f64>() / n as f64,
        ReduceOp::Max => vals.iter().cloned().fold(f64::MIN, f64::max),
        ReduceOp::Min => vals.iter().cloned().fold(f64::MAX, f64::min),
        ReduceOp::Product => vals.iter().product(),
        ReduceOp::BitAnd => vals.iter().fold(!0i64, |a, v| a & *v as i64) as f64,
        ReduceOp::BitOr => vals.iter().fold(0i64, |a, v| a | *v as i64) as f64,
        ReduceOp::BitXor => vals.iter().fold(0i64, |a, v| a ^ *v as i64) as f64,
    }
}

fn check_all_reduce(pg: &ProcessGroup) {
    let (r, n) = (pg.rank(), pg.size());
    for &len in &SIZES {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product] {
            let mut a: Vec<f32> = (0..len).map(|i| val(r, i) as f32).collect();
            pg.all_reduce(&mut a, op).unwrap();
            for (i, x) in a.iter().enumerate() {
                assert_eq!(
                    *x as f64,
                    expected(n, i, op) as f32 as f64,
                    "f32 {op:?} len {len} i {i} n {n}"
                );
            }
        }
        let mut d: Vec<f64> = (0..len).map(|i| val(r, i)).collect();
        pg.all_reduce(&mut d, ReduceOp::Avg).unwrap();
        assert!(
            d.iter().enumerate().all(|(i, x)| *x == expected(n, i, ReduceOp::Avg)),
            "f64 avg len {len}"
        );
        let mut h: Vec<f16> = (0..len).map(|i| f16::from_f64(val(r, i))).collect();
        pg.all_reduce(&mut h, ReduceOp::Sum).unwrap();
        assert!(
            h.iter().enumerate().all(|(i, x)| x.to_f64() == expected(n, i, ReduceOp::Sum)),
            "f16 len {len}"
        );
        let mut b: Vec<bf16> = (0..len).map(|i| bf16::from_f64(val(r, i))).collect();
        pg.all_reduce(&mut b, ReduceOp::Max).unwrap();
        assert!(
            b.iter().enumerate().all(|(i, x)| x.to_f64() == expected(n, i, ReduceOp::Max)),
            "bf16 len {len}"
        );
        let mut k: Vec<i32> = (0..len).map(|i| val(r, i) as i32).collect();
        pg.all_reduce(&mut k, ReduceOp::Product).unwrap();
        assert!(
            k.iter().enumerate().all(|(i, x)| *x as f64 == expected(n, i, ReduceOp::Product)),
            "i32 len {len}"
        );
        let mut l: Vec<i64> = (0..len).map(|i| val(r, i) as i64 - 3).collect();
        pg.all_reduce(&mut l, ReduceOp::Min).unwrap();
        assert!(
            l.iter().enumerate().all(|(i, x)| *x as f64 == expected(n, i, ReduceOp::Min) - 3.0),
            "i64 len {len}"
        );
        for op in [ReduceOp::BitAnd, ReduceOp::BitOr, ReduceOp::BitXor] {
            let mut w: Vec<i64> = (0..len).map(|i| val(r, i) as i64).collect();
            pg.all_reduce(&mut w, op).unwrap();
            assert!(
                w.iter().enumerate().all(|(i, x)| *x as f64 == expected(n, i, op)),
                "i64 {op:?} len {len}"
            );
        }
        let mut u: Vec<u8> = (0..len).map(|i| val(r, i) as u8).collect();
        pg.all_reduce(&mut u, ReduceOp::Sum).unwrap();
        assert!(
            u.iter().enumerate().all(|(i, x)| *x as f64 == expected(n, i, ReduceOp::Sum)),
            "u8 len {len}"
        );
    }
}

fn check_others(pg: &ProcessGroup) {
    let (r, n) = (pg.rank(), pg.size());
    for &len in &SIZES {
        for root in 0..n {
            let mut b: Vec<i64> = if r == root {
                (0..len as i64).map(|i| i * 7 + root as i64).collect()
            } else {
                vec![-1; len]
            };
            pg.broadcast(&mut b, root).unwrap();
            assert!(
                b.iter().enumerate().all(|(i, x)| *x == i as i64 * 7 + root as i64),
                "broadcast root {root} len {len}"
            );
        }
        let input: Vec<f32> = (0..len).map(|i| (r * 10000 + i) as f32).collect();
        let mut out = vec![0f32; n * len];
        pg.all_gather(&input, &mut out).unwrap();
        for q in 0..n {
            for i in 0..len {
                assert_eq!(out[q * len + i], (q * 10000 + i) as f32, "all_gather len {len}");
            }
        }
        let big: Vec<i32> = (0..n * len).map(|i| (i * (r + 1)) as i32).collect();
        let mut mine = vec![0i32; len];
        pg.reduce_scatter(&big, &mut mine, ReduceOp::Sum).unwrap();
        let factor: usize = (1..=n).sum();
        for (i, x) in mine.iter().enumerate() {
            assert_eq!(*x as usize, (r * len + i) * factor, "reduce_scatter len {len}");
        }
        let root = n - 1;
        let mut gathered = vec![0f64; n * len];
        let out = if r == root { Some(&mut gathered[..]) } else { None };
        pg.gather(&input.iter().map(|x| *x as f64).collect::<Vec<_>>(), out, root).unwrap();
        if r == root {
            for q in 0..n {
                for i in 0..len {
                    assert_eq!(gathered[q * len + i], (q * 10000 + i) as f64, "gather len {len}");
                }
            }
        }
        let src: Vec<u8> = (0..n * len).map(|i| (i % 251) as u8).collect();
        let mut part = vec![0u8; len];
        pg.scatter(if r == 0 { Some(&src[..]) } else { None }, &mut part, 0).unwrap();
        assert_eq!(&part[..], &src[r * len..(r + 1) * len], "scatter len {len}");
    }
    // variable-length bytes
    let mine: Vec<u8> = (0..r * 3 + 1).map(|i| (i + r) as u8).collect();
    let all = pg.all_gather_bytes(&mine).unwrap();
    for (q, v) in all.iter().enumerate() {
        assert_eq!(v, &(0..q * 3 + 1).map(|i| (i + q) as u8).collect::<Vec<_>>());
    }
    let mut blob = if r == 0 { b"config: 42".repeat(1000) } else { b"stale".to_vec() };
    pg.broadcast_bytes(&mut blob, 0).unwrap();
    assert_eq!(blob, b"config: 42".repeat(1000));
    pg.barrier().unwrap();
    // point to point around the ring
    if n > 1 {
        let to = (r + 1) % n;
        let from = (r + n - 1) % n;
        let msg: Vec<i64> = vec![r as i64; 5];
        let mut got = vec![0i64; 5];
        if r % 2 == 0 {
            pg.send(&msg, to).unwrap();
            pg.recv(&mut got, from).unwrap();
        } else {
            pg.recv(&mut got, from).unwrap();
            pg.send(&msg, to).unwrap();
        }
        assert_eq!(got, vec![from as i64; 5]);
    }
    // async calls keep issue order
    let works: Vec<_> =
        (0..4).map(|k| pg.all_reduce_async(vec![(k + r) as f32; 33], ReduceOp::Sum)).collect();
    for (k, w) in works.into_iter().enumerate() {
        let v = w.wait().unwrap();
        let want: usize = (0..n).map(|q| k + q).sum();
        assert!(v.iter().all(|x| *x == want as f32));
    }
}

fn matrix(kind: TransportKind) {
    for n in 1..=4 {
        let kinds = run_world(n, kind, |pg| {
            check_all_reduce(&pg);
            check_others(&pg);
            pg.transport()
        });
        let want = if n == 1 { None } else { Some(kind) };
        assert!(kinds.iter().all(|k| *k == want), "transport {kinds:?}");
    }
}

#[test]
fn tcp_collectives_world_1_to_4() {
    matrix(TransportKind::Tcp);
}

#[test]
fn shm_collectives_world_1_to_4() {
    matrix(TransportKind::Shm);
}

#[test]
fn large_buffers_stream_through_scratch_and_rings() {
    // 3 MB per rank: larger than the TCP reduce scratch and the shared-memory rings.
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        for n in [2, 3] {
            run_world(n, kind, |pg| {
                let len = 750_001;
                let mut v: Vec<f32> =
                    (0..len).map(|i| ((i % 1000) * (pg.rank() + 1)) as f32).collect();
                pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                let f: usize = (1..=pg.size()).sum();
                assert!(v.iter().enumerate().all(|(i, x)| *x == ((i % 1000) * f) as f32));
                let mut b: Vec<u8> = if pg.rank() == 1 {
                    (0..len).map(|i| (i % 253) as u8).collect()
                } else {
                    vec![0; len]
                };
                pg.broadcast(&mut b, 1).unwrap();
                assert!(b.iter().enumerate().all(|(i, x)| *x == (i % 253) as u8));
            });
        }
    }
}

#[test]
fn sub_groups_run_their_own_collectives() {
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let out = run_world(4, kind, |pg| {
            let even = pg.new_group(&[0, 2]).unwrap();
            let odd = pg.new_group(&[1, 3]).unwrap();
            let g = even.or(odd).expect("every rank is in one group");
            assert_eq!(g.size(), 2);
            let mut v = vec![pg.rank() as i64; 9];
            g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            // the world group still works after sub-groups were made
            let mut w = vec![1i64; 3];
            pg.all_reduce(&mut w, ReduceOp::Sum).unwrap();
            assert_eq!(w, vec![4; 3]);
            (g.rank(), g.world_ranks().to_vec(), v[0])
        });
        assert_eq!(out[0], (0, vec![0, 2], 2));
        assert_eq!(out[1], (0, vec![1, 3], 4));
        assert_eq!(out[2], (1, vec![0, 2], 2));
        assert_eq!(out[3], (1, vec![1, 3], 4));
    }
}

/// Aborting a group aborts the groups made from it (a live regroup aborts the old
/// generation's group: collectives on its sub-groups must fail too, not wait for a peer that
/// moved on), with the same reason.
#[test]
fn aborting_a_group_aborts_its_sub_groups() {
    let out = run_world(2, TransportKind::Tcp, |pg| {
        let side = pg.new_group(&[0, 1]).unwrap().expect("a member");
        let mut v = vec![1.0f32; 4];
        side.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!((pg.failure(), side.failure()), (None, None));
        pg.abort("regrouping");
        let e = side.all_reduce(&mut v, ReduceOp::Sum).unwrap_err().to_string();
        (side.failure(), e)
    });
    for (rank, (failure, e)) in out.iter().enumerate() {
        assert_eq!(failure.as_deref(), Some("regrouping"), "rank {rank}");
        assert!(e.contains("regrouping"), "rank {rank}: {e}");
    }
}

/// A length a peer announces for variable-size bytes is checked before anything is allocated,
/// against what the caller says the operation can need (a failed group stays failed, so each
/// case is a world of its own).
#[test]
fn announced_byte_lengths_beyond_the_callers_bound_are_refused_before_allocating() {
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let gathered = run_world(2, kind, |pg| {
            let mine = vec![7u8; if pg.rank() == 1 { 1000 } else { 10 }];
            pg.all_gather_bytes_at_most(&mine, 100).map(|_| ()).map_err(|e| e.to_string())
        });
        for (rank, result) in gathered.into_iter().enumerate() {
            let e = result.expect_err("1000 bytes from rank 1 exceed the bound of 100");
            assert!(e.contains("announced 1000 bytes, more than the 100"), "{kind:?} {rank}: {e}");
        }
        let broadcast = run_world(2, kind, |pg| {
            let mut blob = if pg.rank() == 0 { vec![1u8; 5000] } else { Vec::new() };
            pg.broadcast_bytes_at_most(&mut blob, 0, 4096).map_err(|e| e.to_string())
        });
        let e = broadcast[1].clone().expect_err("5000 bytes exceed 4096");
        assert!(e.contains("announced 5000 bytes, more than the 4096"), "{kind:?}: {e}");
        // Within the bound, the same calls work.
        let fine = run_world(2, kind, |pg| {
            let mut blob = if pg.rank() == 0 { vec![1u8; 5000] } else { Vec::new() };
            pg.broadcast_bytes_at_most(&mut blob, 0, 5000).map(|_| blob.len()).unwrap()
        });
        assert_eq!(fine, vec![5000, 5000]);
    }
}
