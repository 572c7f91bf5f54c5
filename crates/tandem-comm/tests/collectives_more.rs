//! The collectives past the core — reduce, PREMUL_SUM, bitwise ops, all_to_all (single and
//! list, uneven splits), all_gather's list form, byte and object collectives with a root, the
//! async forms, P2P (isend/irecv, batch_isend_irecv), monitored_barrier, subgroups and
//! DeviceMesh — on both transports, world sizes 1-4, with the errors a caller can make.
//! (`torch_collectives.rs` checks the same calls against PyTorch's gloo.)
mod common;
use common::{opts, run_world, run_world_with};
use half::f16;
use std::time::Duration;
use tandem_comm::{DeviceMesh, P2POp, ProcessGroup, ReduceOp, TransportKind};

const KINDS: [TransportKind; 2] = [TransportKind::Tcp, TransportKind::Shm];

/// Elements rank `from` sends rank `to` in the uneven all_to_all (zero for some pairs).
fn count(from: usize, to: usize) -> usize {
    (2 * from + to) % 4
}

fn value(from: usize, to: usize, i: usize) -> i64 {
    (from * 1000 + to * 100 + i) as i64
}

fn check_reduce(pg: &ProcessGroup) {
    let (r, n) = (pg.rank(), pg.size());
    for dst in 0..n {
        let mine: Vec<f32> = (0..13).map(|i| (i * (r + 1)) as f32).collect();
        let mut buf = mine.clone();
        pg.reduce(&mut buf, ReduceOp::Sum, dst).unwrap();
        let f: usize = (1..=n).sum();
        if r == dst {
            assert!(buf.iter().enumerate().all(|(i, x)| *x == (i * f) as f32), "reduce to {dst}");
        } else {
            assert_eq!(buf, mine, "a non-root buffer changed");
        }
        let mut ints: Vec<i64> = (0..7).map(|i| (i + r) as i64 * 3).collect();
        pg.reduce(&mut ints, ReduceOp::BitXor, dst).unwrap();
        if r == dst {
            let want: Vec<i64> =
                (0..7).map(|i| (0..n).fold(0, |a, q| a ^ ((i + q) as i64 * 3))).collect();
            assert_eq!(ints, want);
        }
        let mut avg = vec![(r * 4) as f64; 5];
        pg.reduce(&mut avg, ReduceOp::Avg, dst).unwrap();
        if r == dst {
            assert_eq!(avg, vec![(0..n).map(|q| q * 4).sum::<usize>() as f64 / n as f64; 5]);
        }
    }
    let e = pg.reduce(&mut [1.0f32], ReduceOp::BitAnd, 0).unwrap_err().to_string();
    assert!(e.contains("band of f32 elements: bitwise reductions take integers"), "{e}");
    let e = pg.reduce(&mut [1i32], ReduceOp::Sum, n).unwrap_err().to_string();
    assert!(e.contains(&format!("root {n} is out of range")), "{e}");

    let mut x = vec![1.5f32, -2.0, 0.25];
    pg.all_reduce_premul_sum(&mut x, 0.5).unwrap();
    let k = n as f32 * 0.5;
    assert_eq!(x, vec![1.5 * k, -2.0 * k, 0.25 * k]);
    let mut h = vec![f16::from_f32(3.0); 4];
    pg.all_reduce_premul_sum(&mut h, 0.1).unwrap();
    let one = f16::from_f32(3.0) * f16::from_f64(0.1);
    let want = (1..n).fold(one, |a, _| a + one);
    assert_eq!(h, vec![want; 4]);
    let e = pg.all_reduce_premul_sum(&mut [1i64], 2.0).unwrap_err().to_string();
    assert!(e.contains("premul_sum of i64 elements"), "{e}");
}

/// Output splits of one element per rank, but two from this rank itself.
fn own(n: usize, r: usize) -> Vec<usize> {
    (0..n).map(|q| 1 + usize::from(q == r)).collect()
}

fn check_all_to_all(pg: &ProcessGroup) {
    let (r, n) = (pg.rank(), pg.size());
    // even
    let input: Vec<i64> = (0..n * 3).map(|k| value(r, k / 3, k % 3)).collect();
    let mut output = vec![0i64; n * 3];
    pg.all_to_all_single(&input, &mut output, None, None).unwrap();
    let want: Vec<i64> = (0..n * 3).map(|k| value(k / 3, r, k % 3)).collect();
    assert_eq!(output, want, "even all_to_all_single");
    // uneven
    let ins: Vec<usize> = (0..n).map(|to| count(r, to)).collect();
    let outs: Vec<usize> = (0..n).map(|from| count(from, r)).collect();
    let input: Vec<i64> =
        (0..n).flat_map(|to| (0..count(r, to)).map(move |i| value(r, to, i))).collect();
    let want: Vec<i64> =
        (0..n).flat_map(|from| (0..count(from, r)).map(move |i| value(from, r, i))).collect();
    let mut output = vec![-1i64; want.len()];
    pg.all_to_all_single(&input, &mut output, Some(&ins), Some(&outs)).unwrap();
    assert_eq!(output, want, "uneven all_to_all_single");
    // list form, async
    let inputs: Vec<Vec<i64>> =
        (0..n).map(|to| (0..count(r, to)).map(|i| value(r, to, i)).collect()).collect();
    let outputs: Vec<Vec<i64>> = (0..n).map(|from| vec![0; count(from, r)]).collect();
    let got = pg.all_to_all_async(inputs, outputs).wait().unwrap();
    for (from, block) in got.iter().enumerate() {
        assert_eq!(block, &(0..count(from, r)).map(|i| value(from, r, i)).collect::<Vec<_>>());
    }
    // all_gather's list form: rank q contributes q + 1 elements
    let mut outs: Vec<Vec<f32>> = (0..n).map(|q| vec![0.0; q + 1]).collect();
    pg.all_gather_list(&vec![r as f32; r + 1], &mut outs).unwrap();
    for (q, o) in outs.iter().enumerate() {
        assert_eq!(o, &vec![q as f32; q + 1]);
    }
    // bad arguments fail before anything moves
    if n > 1 {
        let e = pg.all_to_all_single(&[1i64; 5], &mut [0; 5], Some(&[5]), None).unwrap_err();
        assert!(e.to_string().contains("input_split_sizes has 1 entries"), "{e}");
    }
    let e = pg.all_to_all_single(&vec![1i64; n], &mut vec![0; n + 1], None, Some(&own(n, r)));
    let e = e.unwrap_err().to_string();
    assert!(e.contains(&format!("rank {r} sends 1 elements to itself but expects 2")), "{e}");
}

fn check_rooted_bytes_and_objects(pg: &ProcessGroup) {
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq, Clone)]
    struct Note {
        rank: usize,
        name: String,
        loss: f64,
    }
    let (r, n) = (pg.rank(), pg.size());
    let root = n - 1;
    let mine: Vec<u8> = (0..r * 5).map(|i| (i + r) as u8).collect();
    let got = pg.gather_bytes(&mine, root).unwrap();
    if r == root {
        let got = got.expect("the root gets every rank's bytes");
        for (q, b) in got.iter().enumerate() {
            assert_eq!(b, &(0..q * 5).map(|i| (i + q) as u8).collect::<Vec<_>>());
        }
    } else {
        assert!(got.is_none());
    }
    let blocks: Vec<Vec<u8>> = (0..n).map(|q| vec![q as u8; 3 * q + 1]).collect();
    let part = pg.scatter_bytes((r == 0).then_some(&blocks[..]), 0).unwrap();
    assert_eq!(part, vec![r as u8; 3 * r + 1]);

    let note = Note { rank: r, name: format!("rank-{r}"), loss: 0.1 * r as f64 };
    let all = pg.all_gather_object(&note).unwrap();
    assert!(all.iter().enumerate().all(|(q, o)| o.rank == q && o.loss == 0.1 * q as f64));
    let mut list = if r == 0 { vec![note.clone(), note.clone()] } else { Vec::new() };
    pg.broadcast_object_list(&mut list, 0).unwrap();
    assert_eq!(list.len(), 2);
    assert_eq!(list[1].name, "rank-0");
    let gathered = pg.gather_object(&note, 0).unwrap();
    assert_eq!(gathered.map(|g| g.len()), (r == 0).then_some(n));
    let notes: Vec<Note> =
        (0..n).map(|q| Note { rank: q, name: "to".repeat(q), loss: -1.0 }).collect();
    let one = pg.scatter_object_list((r == 0).then_some(&notes[..]), 0).unwrap();
    assert_eq!(one, notes[r]);
    // Another type than was sent fails naming the sender, on the ranks that asked for it.
    if r == 0 {
        let words: Vec<String> = (0..n).map(|q| format!("w{q}")).collect();
        assert_eq!(pg.scatter_object_list(Some(&words[..]), 0).unwrap(), "w0");
    } else {
        let e = pg.scatter_object_list::<u32>(None, 0).unwrap_err().to_string();
        assert!(e.contains("the object of rank 0 does not decode as u32"), "{e}");
    }
}

fn check_async(pg: &ProcessGroup) {
    let (r, n) = (pg.rank(), pg.size());
    let a = pg.all_gather_async(vec![r as i32; 2], vec![0; 2 * n]);
    let b = pg.reduce_scatter_async(vec![1.0f64; 3 * n], vec![0.0; 3], ReduceOp::Sum);
    let c = pg.gather_async(vec![r as u8], (r == 0).then(|| vec![0u8; n]), 0);
    let d = pg.scatter_async((r == 0).then(|| (0..n as i64).collect()), vec![-1i64], 0);
    let e = pg.reduce_async(vec![2i32; 4], ReduceOp::Product, 0);
    let f = pg.all_to_all_single_async((0..n as i64).collect(), vec![0; n], None, None);
    let g = pg.all_gather_list_async(vec![r as f32], (0..n).map(|_| vec![0.0]).collect());
    let h = pg.barrier_async();
    let i = pg.all_reduce_premul_sum_async(vec![1.0f32; 3], 2.0);
    assert_eq!(a.wait().unwrap(), (0..n).flat_map(|q| [q as i32; 2]).collect::<Vec<_>>());
    assert_eq!(b.wait().unwrap(), vec![n as f64; 3]);
    assert_eq!(c.wait().unwrap(), (r == 0).then(|| (0..n as u8).collect::<Vec<_>>()));
    assert_eq!(d.wait().unwrap(), vec![r as i64]);
    let prod = e.wait().unwrap();
    if r == 0 {
        assert_eq!(prod, vec![1 << n; 4]);
    }
    assert_eq!(f.wait().unwrap(), vec![r as i64; n]);
    assert_eq!(g.wait().unwrap(), (0..n).map(|q| vec![q as f32]).collect::<Vec<_>>());
    h.wait().unwrap();
    assert_eq!(i.wait().unwrap(), vec![2.0 * n as f32; 3]);
    // The async reduce-scatter reduces into the input it was handed: each rank still gets its
    // own block's average, as from the blocking form (which reduces into a copy).
    let input: Vec<f32> = (0..3 * n).map(|i| (100 * r + i) as f32).collect();
    let mine = pg.reduce_scatter_async(input.clone(), vec![0.0; 3], ReduceOp::Avg);
    let mut blocking = vec![0.0f32; 3];
    pg.reduce_scatter(&input, &mut blocking, ReduceOp::Avg).unwrap();
    let want: Vec<f32> = (0..3).map(|j| (50 * (n - 1) + 3 * r + j) as f32).collect();
    assert_eq!(mine.wait().unwrap(), want, "rank {r}: async reduce-scatter");
    assert_eq!(blocking, want, "rank {r}: reduce-scatter");
}

fn check_p2p(pg: &ProcessGroup) {
    let (r, n) = (pg.rank(), pg.size());
    if n == 1 {
        let e = pg.isend(vec![1u8], 0).wait().unwrap_err().to_string();
        assert!(e.contains("peer 0 must be another rank"), "{e}");
        return;
    }
    // Messages to one peer arrive in the order they were sent.
    if r == 0 {
        let works: Vec<_> = (0..3).map(|k| pg.isend(vec![k as i64; 4 + k], 1)).collect();
        works.into_iter().for_each(|w| drop(w.wait().unwrap()));
    } else if r == 1 {
        let works: Vec<_> = (0..3).map(|k| pg.irecv(vec![0i64; 4 + k], 0)).collect();
        for (k, w) in works.into_iter().enumerate() {
            assert_eq!(w.wait().unwrap(), vec![k as i64; 4 + k]);
        }
    }
    // A ring shift of 4 MB per rank in one batch: every rank sends before it receives, which
    // blocks on full socket buffers unless the batch runs both together.
    let len = 1 << 20;
    let (to, from) = ((r + 1) % n, (r + n - 1) % n);
    let ops = vec![P2POp::isend(vec![r as f32; len], to), P2POp::irecv(vec![0f32; len], from)];
    let done = pg.batch_isend_irecv(ops).wait().unwrap();
    assert!(done[1].buf.iter().all(|x| *x == from as f32));
    assert_eq!(done[0].buf.len(), len, "a send's buffer comes back");
}

fn matrix(kind: TransportKind) {
    for n in 1..=4 {
        run_world(n, kind, |pg| {
            check_reduce(&pg);
            check_all_to_all(&pg);
            check_rooted_bytes_and_objects(&pg);
            check_async(&pg);
            check_p2p(&pg);
            pg.monitored_barrier(Some(Duration::from_secs(5))).unwrap();
            // `tandem check`'s end-to-end check passes on a sound group.
            pg.self_check().unwrap_or_else(|e| panic!("rank {}: {e}", pg.rank()));
        });
    }
}

#[test]
fn tcp_more_collectives_world_1_to_4() {
    matrix(TransportKind::Tcp);
}

#[test]
fn shm_more_collectives_world_1_to_4() {
    matrix(TransportKind::Shm);
}

#[test]
fn split_sizes_that_disagree_fail_on_both_ranks_naming_them() {
    for kind in KINDS {
        let out = run_world(2, kind, |pg| {
            // Rank 0 sends 2 elements to rank 1, which expects 3.
            let (ins, outs) = if pg.rank() == 0 { ([1, 2], [1, 1]) } else { ([1, 1], [3, 1]) };
            let input = vec![1i32; ins.iter().sum()];
            let mut output = vec![0i32; outs.iter().sum()];
            pg.all_to_all_single(&input, &mut output, Some(&ins), Some(&outs))
                .map_err(|e| e.to_string())
        });
        let e1 = out[1].clone().unwrap_err();
        assert!(e1.contains("rank 0 sends 2 elements to rank 1, which expects 3"), "{e1}");
        assert!(out[0].is_err(), "rank 0 must fail too, not hang");
        let lists = run_world(2, kind, |pg| {
            let mut outs = vec![vec![0u8; 1], vec![0u8; 2]];
            let mine = vec![1u8; if pg.rank() == 0 { 1 } else { 3 }];
            if pg.rank() == 1 {
                outs[1] = vec![0; 3];
            }
            pg.all_gather_list(&mine, &mut outs).map_err(|e| e.to_string())
        });
        let e0 = lists[0].clone().unwrap_err();
        assert!(
            e0.contains("rank 1 contributes 3 elements, but outputs[1] on rank 0 has 2"),
            "{e0}"
        );
    }
}

#[test]
fn monitored_barrier_names_every_rank_that_did_not_arrive() {
    let out = run_world(4, TransportKind::Tcp, |pg| {
        if pg.rank() >= 2 {
            std::thread::sleep(Duration::from_millis(1500));
        }
        let r = pg.monitored_barrier(Some(Duration::from_millis(500)));
        (r.map_err(|e| e.to_string()), pg.barrier().map_err(|e| e.to_string()))
    });
    for (rank, (first, after)) in out.iter().enumerate() {
        let e = first.clone().unwrap_err();
        assert!(e.contains("rank(s) 2, 3 did not arrive within 500ms"), "rank {rank}: {e}");
        let after = after.clone().unwrap_err();
        assert!(after.contains("already failed"), "rank {rank}: the group stays broken: {after}");
    }
}

#[test]
fn subgroups_and_a_two_dimensional_mesh_from_one_store() {
    for kind in KINDS {
        let out = run_world(6, kind, |pg| {
            let pairs = pg.new_subgroups(Some(2)).unwrap();
            let e = pg.new_subgroups(Some(4)).unwrap_err().to_string();
            assert!(e.contains("group_size 4 does not divide the group's 6 ranks"), "{e}");
            let e = pg.new_subgroups_by_enumeration(&[vec![0, 1], vec![1, 2]]).unwrap_err();
            assert!(e.to_string().contains("rank 1 is in subgroups 0 and 1"), "{e}");
            let odd = pg.new_subgroups_by_enumeration(&[vec![1, 3, 5]]).unwrap();
            assert_eq!(odd.is_some(), pg.rank() % 2 == 1);
            // 2 x 3: [[0, 1, 2], [3, 4, 5]]; "shard" along rows, "replicate" down columns.
            let mesh = DeviceMesh::new(&pg, &[2, 3], Some(&["replicate", "shard"])).unwrap();
            assert_eq!(mesh.dim_names(), ["replicate", "shard"]);
            let mut row_sum = vec![pg.rank() as i64];
            mesh.group_named("shard").unwrap().all_reduce(&mut row_sum, ReduceOp::Sum).unwrap();
            let mut col_sum = vec![pg.rank() as i64];
            mesh.group(0).unwrap().all_reduce(&mut col_sum, ReduceOp::Sum).unwrap();
            (
                pairs.world_ranks().to_vec(),
                mesh.coordinate().to_vec(),
                mesh.group(1).unwrap().world_ranks().to_vec(),
                row_sum[0],
                col_sum[0],
            )
        });
        assert_eq!(out[3], (vec![2, 3], vec![1, 0], vec![3, 4, 5], 12, 3));
        assert_eq!(out[2], (vec![2, 3], vec![0, 2], vec![0, 1, 2], 3, 7));
    }
}

#[test]
fn the_desync_check_names_the_new_collectives() {
    let mut o = opts(TransportKind::Tcp);
    o.desync_check = true;
    let out = run_world_with(2, o, Duration::from_secs(30), |pg| {
        let r = if pg.rank() == 0 {
            pg.reduce(&mut [1i64; 3], ReduceOp::Max, 1)
        } else {
            pg.all_to_all_single(&[1i64; 2], &mut [0; 2], None, None)
        };
        r.map_err(|e| e.to_string())
    });
    let e = out[0].clone().unwrap_err();
    assert!(e.contains("reduce(#0, i64, 3 elements, max, root 1)"), "{e}");
    assert!(e.contains("all_to_all(#0, i64"), "{e}");
}
