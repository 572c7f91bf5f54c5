//! tandem's collectives against PyTorch's gloo on the same inputs (skipped without torch unless
//! TANDEM_REQUIRE_TORCH=1): reduce with every operator, the bitwise all_reduces, AVG,
//! all_to_all_single even and with uneven splits, all_to_all and all_gather's list forms,
//! gather / scatter / reduce_scatter, a batched P2P ring shift, isend/irecv order, and the four
//! object collectives. `scripts/torch_collectives.py` runs the same program in torch; every
//! rank's results must be equal value for value, for 3 and 4 ranks, on tcp and shm.
mod common;
use common::run_world;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use tandem_comm::{P2POp, ProcessGroup, ReduceOp, TransportKind};
use tandem_testutil::{output_with_deadline, torch_python};

const WORLDS: [usize; 2] = [3, 4];

fn val(r: usize, i: usize) -> f32 {
    ((r * 7 + i * 3) % 11) as f32 - 5.0
}

fn count(from: usize, to: usize) -> usize {
    (2 * from + to) % 4
}

fn value(from: usize, to: usize, i: usize) -> i64 {
    (from * 1000 + to * 100 + i) as i64
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Note {
    rank: usize,
    name: String,
    loss: f64,
}

fn f32s(v: &[f32]) -> Value {
    json!(v.iter().map(|x| *x as f64).collect::<Vec<_>>())
}

/// The program of `torch_collectives.py`, step for step.
fn program(pg: &ProcessGroup) -> BTreeMap<String, Value> {
    let (r, n) = (pg.rank(), pg.size());
    let mut out = BTreeMap::new();
    let mut put = |k: &str, v: Value| out.insert(k.to_string(), v);

    let mut x: Vec<f32> = (0..10).map(|i| val(r, i)).collect();
    pg.reduce(&mut x, ReduceOp::Sum, 1).unwrap();
    if r == 1 {
        put("reduce_sum_f32", f32s(&x));
    }
    let mut x: Vec<i64> = (0..7).map(|i| ((r * 5 + i) % 9) as i64 - 4).collect();
    pg.reduce(&mut x, ReduceOp::Max, 0).unwrap();
    if r == 0 {
        put("reduce_max_i64", json!(x));
    }
    let mut x: Vec<i32> = (0..6).map(|i| ((r + i) % 3 + 1) as i32).collect();
    pg.reduce(&mut x, ReduceOp::Product, n - 1).unwrap();
    if r == n - 1 {
        put("reduce_product_i32", json!(x));
    }
    for (name, op) in
        [("band", ReduceOp::BitAnd), ("bor", ReduceOp::BitOr), ("bxor", ReduceOp::BitXor)]
    {
        let mut x: Vec<i64> = (0..9).map(|i| ((r * 37 + i * 11) % 64) as i64).collect();
        pg.reduce(&mut x, op, 0).unwrap();
        if r == 0 {
            put(&format!("reduce_{name}_i64"), json!(x));
        }
        let mut y: Vec<i32> = (0..9).map(|i| ((r * 13 + i * 5) % 32) as i32).collect();
        pg.all_reduce(&mut y, op).unwrap();
        put(&format!("all_reduce_{name}_i32"), json!(y));
    }
    let mut x: Vec<f32> = (0..5).map(|i| val(r, i) * 4.0).collect();
    pg.all_reduce(&mut x, ReduceOp::Avg).unwrap();
    put("all_reduce_avg_f32", f32s(&x));

    let x: Vec<f32> = (0..2 * n).map(|i| val(r, i)).collect();
    let mut y = vec![0f32; 2 * n];
    pg.all_to_all_single(&x, &mut y, None, None).unwrap();
    put("all_to_all_single_even_f32", f32s(&y));
    let ins: Vec<usize> = (0..n).map(|t| count(r, t)).collect();
    let outs: Vec<usize> = (0..n).map(|f| count(f, r)).collect();
    let x: Vec<i64> = (0..n).flat_map(|t| (0..count(r, t)).map(move |i| value(r, t, i))).collect();
    let mut y = vec![-1i64; outs.iter().sum()];
    pg.all_to_all_single(&x, &mut y, Some(&ins), Some(&outs)).unwrap();
    put("all_to_all_single_uneven_i64", json!(y));
    let xs: Vec<Vec<f64>> =
        (0..n).map(|t| (0..2).map(|i| value(r, t, i) as f64 / 8.0).collect()).collect();
    let mut ys = vec![vec![0f64; 2]; n];
    pg.all_to_all(&xs, &mut ys).unwrap();
    put("all_to_all_list_f64", json!(ys));

    let mut ys = vec![vec![0f32; 3]; n];
    pg.all_gather_list(&(0..3).map(|i| val(r, i)).collect::<Vec<_>>(), &mut ys).unwrap();
    put("all_gather_list_f32", json!(ys.iter().map(|y| f32s(y)).collect::<Vec<_>>()));
    let x: Vec<f32> = (0..4).map(|i| val(r, i)).collect();
    let mut g = vec![0f32; 4 * n];
    pg.gather(&x, (r == 0).then_some(&mut g[..]), 0).unwrap();
    if r == 0 {
        put("gather_f32", json!(g.chunks(4).map(f32s).collect::<Vec<_>>()));
    }
    let src = 1 % n;
    let all: Vec<i64> = (0..n).flat_map(|q| (0..3).map(move |i| (q * 10 + i) as i64)).collect();
    let mut y = vec![0i64; 3];
    pg.scatter((r == src).then_some(&all[..]), &mut y, src).unwrap();
    put("scatter_i64", json!(y));
    let x: Vec<f32> = (0..n).flat_map(|q| (0..2).map(move |i| val(r, q + i))).collect();
    let mut y = vec![0f32; 2];
    pg.reduce_scatter(&x, &mut y, ReduceOp::Sum).unwrap();
    put("reduce_scatter_f32", f32s(&y));

    let (to, from) = ((r + 1) % n, (r + n - 1) % n);
    let ops = vec![
        P2POp::isend((0..5).map(|i| (r * 10 + i) as f32).collect(), to),
        P2POp::irecv(vec![0f32; 5], from),
    ];
    let done = pg.batch_isend_irecv(ops).wait().unwrap();
    put("p2p_ring_f32", f32s(&done[1].buf));
    if r == 0 {
        let works: Vec<_> = (0..3).map(|k| pg.isend(vec![k as i64; k + 2], 1)).collect();
        works.into_iter().for_each(|w| drop(w.wait().unwrap()));
    } else if r == 1 {
        let works: Vec<_> = (0..3).map(|k| pg.irecv(vec![0i64; k + 2], 0)).collect();
        let got: Vec<Vec<i64>> = works.into_iter().map(|w| w.wait().unwrap()).collect();
        put("p2p_order_i64", json!(got));
    }

    let note = Note { rank: r, name: format!("rank-{r}"), loss: r as f64 / 8.0 };
    put("all_gather_object", json!(pg.all_gather_object(&note).unwrap()));
    if let Some(got) = pg.gather_object(&note, 0).unwrap() {
        put("gather_object", json!(got));
    }
    let mut list: Vec<Value> = if r == n - 1 {
        vec![json!("from"), json!(n - 1), json!({"k": [1, 2]})]
    } else {
        vec![Value::Null; 3]
    };
    pg.broadcast_object_list(&mut list, n - 1).unwrap();
    put("broadcast_object_list", json!(list));
    let objs: Vec<Value> = (0..n).map(|q| json!({"to": q, "w": vec![q; q]})).collect();
    let mine: Value = pg.scatter_object_list((r == 0).then_some(&objs[..]), 0).unwrap();
    put("scatter_object_list", mine);
    out
}

fn torch_results(python: &Path, dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/torch_collectives.py");
    let mut cmd = Command::new(python);
    cmd.arg(script).arg(dir).args(WORLDS.map(|n| n.to_string()));
    let out = output_with_deadline(&mut cmd, Duration::from_secs(300));
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("OK"),
        "torch_collectives.py failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn every_collective_matches_pytorch_gloo_on_the_same_inputs() {
    let Some(python) = torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    torch_results(&python, dir.path());
    for n in WORLDS {
        for kind in [TransportKind::Tcp, TransportKind::Shm] {
            let ours = run_world(n, kind, |pg| program(&pg));
            for (rank, ours) in ours.iter().enumerate() {
                let file = dir.path().join(format!("n{n}_rank{rank}.json"));
                let text = std::fs::read_to_string(&file).unwrap();
                let theirs: BTreeMap<String, Value> = serde_json::from_str(&text).unwrap();
                assert_eq!(
                    ours.keys().collect::<Vec<_>>(),
                    theirs.keys().collect::<Vec<_>>(),
                    "{kind:?} n={n} rank {rank}: steps"
                );
                for (step, want) in &theirs {
                    assert_eq!(&ours[step], want, "{kind:?} n={n} rank {rank}: {step}");
                }
            }
        }
    }
}
