//! Failure semantics inside one process (threads with real sockets / shared memory): stalled
//! peers time out with an error naming op, sequence number and peer; a failed group stays
//! failed; desync detection names both ranks and both calls; bad arguments are errors.
mod common;
use common::{opts, run_world_with};
use std::time::{Duration, Instant};
use tandem_comm::{CommError, ReduceOp, TransportKind};

#[test]
fn stalled_peer_times_out_naming_op_seq_and_peer() {
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let mut o = opts(kind);
        o.timeout = Duration::from_millis(700);
        let out = run_world_with(2, o, Duration::from_secs(20), |pg| {
            let mut v = vec![1.0f32; 100];
            pg.all_reduce(&mut v, ReduceOp::Sum).unwrap(); // #0 succeeds on both
            if pg.rank() == 1 {
                std::thread::sleep(Duration::from_millis(2500)); // stall, then leave
                return None;
            }
            let t = Instant::now();
            let e = pg.all_reduce(&mut v, ReduceOp::Sum).expect_err("must time out");
            let took = t.elapsed();
            let again = pg.all_reduce(&mut v, ReduceOp::Sum).expect_err("group is broken");
            Some((e, took, again))
        });
        let (e, took, again) = out.into_iter().next().flatten().expect("rank 0 result");
        assert!(
            matches!(e, CommError::Timeout { op: "all_reduce", seq: 1, peer: 1, .. }),
            "{kind:?}: {e}"
        );
        let msg = e.to_string();
        assert!(msg.contains("all_reduce #1") && msg.contains("peer rank 1"), "{msg}");
        assert!(
            took >= Duration::from_millis(650) && took < Duration::from_secs(5),
            "{kind:?} took {took:?}"
        );
        assert!(matches!(again, CommError::Broken { seq: 2, .. }), "{again}");
    }
}

#[test]
fn desync_names_both_ranks_and_calls() {
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let mut o = opts(kind);
        o.desync_check = true;
        o.timeout = Duration::from_secs(5);
        let out = run_world_with(3, o, Duration::from_secs(20), |pg| {
            let mut v = vec![1.0f32; 10];
            pg.all_reduce(&mut v, ReduceOp::Sum).unwrap(); // agreeing calls pass the check
            match pg.rank() {
                2 => pg.broadcast(&mut v, 0).expect_err("desync"),
                1 => pg.all_reduce(&mut [1.0f32; 11], ReduceOp::Sum).expect_err("desync"),
                _ => pg.all_reduce(&mut v, ReduceOp::Sum).expect_err("desync"),
            }
        });
        for e in &out {
            let msg = e.to_string();
            assert!(matches!(e, CommError::Desync { rank_a: 0, rank_b: 1, .. }), "{kind:?}: {msg}");
            assert!(msg.contains("all_reduce(#1, f32, 10 elements, sum)"), "{msg}");
            assert!(msg.contains("all_reduce(#1, f32, 11 elements, sum)"), "{msg}");
        }
    }
}

#[test]
fn desync_in_point_to_point_names_both_calls() {
    let mut o = opts(TransportKind::Tcp);
    o.desync_check = true;
    let out = run_world_with(2, o, Duration::from_secs(20), |pg| {
        if pg.rank() == 0 {
            let _ = pg.send(&[1i64, 2, 3], 1);
            None
        } else {
            Some(pg.recv(&mut [0i32; 3], 0).expect_err("dtype mismatch"))
        }
    });
    let e = out[1].as_ref().expect("rank 1 error");
    let msg = e.to_string();
    assert!(
        msg.contains("recv(#0, i32, 3 elements, from 0)")
            && msg.contains("send(#0, i64, 3 elements, to 1)"),
        "{msg}"
    );
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let out = run_world_with(2, opts(TransportKind::Tcp), Duration::from_secs(20), |pg| {
        let errs = [
            pg.broadcast(&mut [0u8; 3], 2).expect_err("root out of range"),
            pg.all_gather(&[0f32; 3], &mut [0f32; 5]).expect_err("wrong output"),
            pg.reduce_scatter(&[0f32; 3], &mut [0f32; 2], ReduceOp::Sum).expect_err("wrong input"),
            pg.send(&[0u8], pg.rank()).expect_err("send to self"),
            pg.new_group(&[0, 0]).expect_err("duplicate"),
            pg.new_group(&[5]).expect_err("out of range"),
        ];
        // the group still works: argument errors do not break it
        let mut v = vec![1u8; 4];
        pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, vec![2; 4]);
        errs.iter().map(|e| e.to_string()).collect::<Vec<_>>()
    });
    for msgs in out {
        assert!(msgs[0].contains("broadcast") && msgs[0].contains("root 2"), "{}", msgs[0]);
        assert!(msgs[1].contains("all_gather"), "{}", msgs[1]);
        assert!(msgs[2].contains("reduce_scatter"), "{}", msgs[2]);
        assert!(msgs[5].contains("rank 5"), "{}", msgs[5]);
    }
}

#[test]
fn world_of_one_needs_no_network() {
    let pg = tandem_comm::init_from(&tandem_comm::InitMethod::Single).unwrap();
    assert_eq!((pg.rank(), pg.size(), pg.local_rank(), pg.local_size()), (0, 1, 0, 1));
    assert!(pg.store().is_none() && pg.transport().is_none());
    let mut v = vec![3.0f64, 4.0];
    pg.all_reduce(&mut v, ReduceOp::Avg).unwrap();
    assert_eq!(v, vec![3.0, 4.0]);
    pg.barrier().unwrap();
    let mut b = b"x".to_vec();
    pg.broadcast_bytes(&mut b, 0).unwrap();
    assert_eq!(pg.all_gather_bytes(b"hi").unwrap(), vec![b"hi".to_vec()]);
    let mut out = [0i32; 2];
    pg.all_gather(&[7], &mut out[..1]).unwrap();
    assert_eq!(out[0], 7);
    assert!(pg.all_reduce_async(vec![1u8], ReduceOp::Sum).wait().is_ok());
    assert!(pg.new_group(&[0]).unwrap().is_some());
}

#[test]
fn unreachable_master_is_an_error_naming_the_address() {
    // (Held bound, not listening, so no other test of a parallel run can take the port.)
    let (_held, port) = tandem_testutil::refused_port();
    let mut o = opts(TransportKind::Tcp);
    o.init_timeout = Duration::from_millis(600);
    let t = Instant::now();
    let e = tandem_comm::init_with(
        &tandem_comm::InitMethod::tcp(&format!("tcp://127.0.0.1:{port}"), 1, 2),
        &o,
    )
    .expect_err("nobody listens");
    assert!(t.elapsed() < Duration::from_secs(5));
    let msg = e.to_string();
    assert!(
        matches!(e, CommError::StoreUnreachable { .. })
            && msg.contains(&format!("127.0.0.1:{port}")),
        "{msg}"
    );
}

#[test]
fn ranks_disagreeing_on_world_size_get_an_error() {
    let port = tandem_testutil::free_port();
    let url = format!("tcp://127.0.0.1:{port}");
    let mut o = opts(TransportKind::Tcp);
    o.init_timeout = Duration::from_secs(2);
    let (u0, o0) = (url.clone(), o.clone());
    let r0 = std::thread::spawn(move || {
        tandem_comm::init_with(&tandem_comm::InitMethod::tcp(&u0, 0, 2), &o0).map(|_| ())
    });
    let r1 = std::thread::spawn(move || {
        tandem_comm::init_with(&tandem_comm::InitMethod::tcp(&url, 1, 3), &o).map(|_| ())
    });
    let e0 = r0.join().unwrap().expect_err("rank 0 must refuse");
    let e1 = r1.join().unwrap().expect_err("rank 1 must fail");
    assert!(e0.to_string().contains("rank 1 was started with world size 3"), "{e0}");
    assert!(
        e1.to_string().contains("did not join") || e1.to_string().contains("world size"),
        "{e1}"
    );
}

#[test]
fn handles_are_send_sync_clone() {
    fn check<T: Send + Sync + Clone + 'static>() {}
    check::<tandem_comm::ProcessGroup>();
    check::<tandem_comm::Store>();
    fn send<T: Send>() {}
    send::<tandem_comm::Work<Vec<f32>>>();
}

#[test]
fn blocking_calls_from_two_threads_run_in_issue_order_on_every_rank() {
    // The DDP pattern: a communication thread all_reduces while the main thread also issues
    // collectives; each rank issues in the same order, so results pair up correctly.
    let out = run_world_with(2, opts(TransportKind::Shm), Duration::from_secs(30), |pg| {
        let comm = pg.clone();
        let (tx, rx) = std::sync::mpsc::channel::<usize>();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            for k in rx {
                let mut v = vec![k as f32; 1000];
                comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                done_tx.send(v[0]).unwrap();
            }
        });
        let mut got = Vec::new();
        for k in 0..20 {
            tx.send(k).unwrap();
            got.push(done_rx.recv().unwrap());
            let mut m = vec![pg.rank() as f64];
            pg.all_reduce(&mut m, ReduceOp::Max).unwrap();
            assert_eq!(m[0], 1.0);
        }
        drop(tx);
        t.join().unwrap();
        got
    });
    for got in out {
        assert_eq!(got, (0..20).map(|k| 2.0 * k as f32).collect::<Vec<_>>());
    }
}

#[test]
fn bad_arguments_to_any_call_are_an_error_and_the_next_collective_still_runs() {
    // Each bad call must fail at once with an error naming the op and the argument, and must
    // not take a place in the call order (which used to block every later call forever).
    let out = run_world_with(2, opts(TransportKind::Tcp), Duration::from_secs(30), |pg| {
        let started = Instant::now();
        let mut errors = Vec::new();
        let mut record =
            |r: Result<(), CommError>| errors.push(r.expect_err("bad call").to_string());
        record(pg.broadcast_async(vec![1.0f32; 4], 2).wait().map(drop));
        record(pg.broadcast(&mut [1.0f32; 4], 7));
        let mut out = vec![0.0f32; 3];
        record(pg.all_gather(&[1.0f32; 2], &mut out));
        record(pg.reduce_scatter(&[1.0f32; 3], &mut [0.0f32; 2], ReduceOp::Sum));
        record(pg.gather(&[1.0f32; 2], None, 5));
        record(pg.scatter(None, &mut [0.0f32; 2], 9));
        record(pg.broadcast_bytes(&mut vec![1u8], 3));
        record(pg.send(&[1.0f32], pg.rank()));
        record(pg.recv(&mut [0.0f32], 4));
        // Then good ones, async and sync, in issue order.
        let w = pg.all_reduce_async(vec![pg.rank() as f32 + 1.0; 8], ReduceOp::Sum);
        let b = pg.broadcast_async(vec![pg.rank() as f32; 3], 1);
        let mut v = vec![1.0f32; 5];
        pg.all_reduce(&mut v, ReduceOp::Sum).expect("a good collective after the bad calls");
        (
            errors,
            w.wait().expect("async all_reduce"),
            b.wait().expect("async broadcast"),
            v,
            started.elapsed(),
        )
    });
    for (errors, reduced, broadcast, v, took) in out {
        let expect_prefix = [
            "broadcast: root 2 is out of range for a group of 2 ranks",
            "broadcast: root 7",
            "all_gather: output has 3 elements",
            "reduce_scatter: input has 3 elements",
            "gather: root 5",
            "scatter: root 9",
            "broadcast_bytes: root 3",
            "send: peer",
            "recv: peer 4",
        ];
        assert_eq!(errors.len(), expect_prefix.len());
        for (e, p) in errors.iter().zip(expect_prefix) {
            assert!(e.starts_with(p), "expected {p:?}…, got {e:?}");
        }
        assert_eq!(reduced, vec![3.0; 8]);
        assert_eq!(broadcast, vec![1.0; 3]);
        assert_eq!(v, vec![2.0; 5]);
        assert!(took < Duration::from_secs(5), "bad calls must fail at once, took {took:?}");
    }
}
