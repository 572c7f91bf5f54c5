//! The MPI transport under a real `mpirun` (OpenMPI): this test binary (`harness = false`)
//! is started by mpirun as every rank, with `TANDEM_MPI_ROLE` saying what to do. Skipped, with
//! the reason, when built without the `mpi` feature or without mpirun, unless
//! TANDEM_REQUIRE_MPI=1 (CI), which makes either a failure.
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use tandem_testutil::child::Running;
use tandem_testutil::{harness, output_with_deadline, without_world};

const ROLE: &str = "TANDEM_MPI_ROLE";
const LIMIT: Duration = Duration::from_secs(120);

fn main() -> ExitCode {
    if let Ok(role) = std::env::var(ROLE) {
        #[cfg(feature = "mpi")]
        ranks::run(&role);
        #[cfg(not(feature = "mpi"))]
        panic!("role {role} needs the mpi feature");
        #[allow(unreachable_code)]
        return ExitCode::SUCCESS;
    }
    let why = harness::skip_unless_required(unavailable(), "TANDEM_REQUIRE_MPI");
    let tests = tandem_testutil::tests![
        mpi_collectives_give_the_defined_results_on_three_ranks,
        a_rank_killed_with_sigkill_ends_the_job_and_mpirun_names_it,
        a_stalled_rank_is_bounded_by_the_group_timeout,
    ];
    harness::main_serial(tests.into_iter().map(|t| t.skip_if(why.clone())).collect())
}

fn unavailable() -> Option<String> {
    if !cfg!(feature = "mpi") {
        return Some(
            "built without the `mpi` feature (cargo test -p tandem-comm --features mpi)".into(),
        );
    }
    harness::mpirun_missing()
}

/// `mpirun -np N` of this binary in `role`, with extra `-x VAR=value` settings.
fn mpirun(n: usize, role: &str, vars: &[(&str, String)]) -> Command {
    let mut c = Command::new("mpirun");
    without_world(&mut c);
    // CI runs as root; oversubscribe: more ranks than this machine's 2 cores.
    c.args(["--allow-run-as-root", "--oversubscribe", "-np", &n.to_string()]);
    let port = tandem_testutil::free_port().to_string();
    let mut all =
        vec![(ROLE, role.to_string()), ("TANDEM_TRANSPORT", "mpi".into()), ("MASTER_PORT", port)];
    all.extend(vars.iter().cloned());
    for (k, v) in all {
        c.arg("-x").arg(format!("{k}={v}"));
    }
    c.arg(std::env::current_exe().unwrap());
    c
}

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn mpi_collectives_give_the_defined_results_on_three_ranks() {
    let out = output_with_deadline(&mut mpirun(3, "collectives", &[]), LIMIT);
    let t = text(&out);
    assert!(out.status.success(), "mpirun failed ({:?}):\n{t}", out.status);
    for r in 0..3 {
        assert!(
            t.contains(&format!("OK rank {r}/3 transport Some(Mpi)")),
            "rank {r} did not pass:\n{t}"
        );
    }
}

fn a_rank_killed_with_sigkill_ends_the_job_and_mpirun_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file: PathBuf = dir.path().join("rank1.pid");
    let job =
        Running::spawn(&mut mpirun(3, "loop", &[("PID_FILE", pid_file.display().to_string())]));
    // Rank 1 writes its pid once it is inside the all_reduce loop.
    let start = Instant::now();
    let pid = loop {
        if let Some(pid) =
            std::fs::read_to_string(&pid_file).ok().and_then(|s| s.trim().parse::<i32>().ok())
        {
            break pid;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "rank 1 never started its loop");
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: sends SIGKILL to the rank's process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let killed_at = Instant::now();
    let done = job.wait(Duration::from_secs(60));
    let ended_after = done.at - killed_at;
    let t = format!("{}{}", done.stdout, done.stderr);
    let status = done.status.unwrap_or_else(|| panic!("the job did not end within 60 s:\n{t}"));
    assert!(!status.success(), "the job should fail:\n{t}");
    assert!(ended_after < Duration::from_secs(30), "the job took {ended_after:?} to end:\n{t}");
    // OpenMPI's report names the rank and the signal.
    assert!(t.contains("rank 1") && (t.contains("signal 9") || t.contains("Killed")), "{t}");
    println!("job ended {ended_after:?} after the kill");
}

fn a_stalled_rank_is_bounded_by_the_group_timeout() {
    let start = Instant::now();
    let out =
        output_with_deadline(&mut mpirun(3, "stall", &[("TANDEM_TIMEOUT", "2".into())]), LIMIT);
    let t = text(&out);
    assert!(!out.status.success(), "the job should fail:\n{t}");
    assert!(start.elapsed() < Duration::from_secs(40), "took {:?}:\n{t}", start.elapsed());
    assert!(t.contains("MPI_Iallreduce") && t.contains("did not complete within 2s"), "{t}");
    assert!(t.contains("aborting the MPI job"), "{t}");
}

#[cfg(feature = "mpi")]
mod ranks {
    use tandem_comm::{ReduceOp, TransportKind};

    pub fn run(role: &str) {
        let pg = tandem_comm::init().unwrap_or_else(|e| panic!("init: {e}"));
        assert_eq!(pg.transport(), Some(TransportKind::Mpi));
        match role {
            "collectives" => collectives(&pg),
            "loop" => {
                let mut v = vec![1.0f32; 1 << 16];
                for i in 0.. {
                    pg.all_reduce(&mut v, ReduceOp::Avg).unwrap();
                    if i == 10 && pg.rank() == 1 {
                        let path = std::env::var("PID_FILE").unwrap();
                        std::fs::write(path, std::process::id().to_string()).unwrap();
                    }
                }
            }
            "stall" => {
                let mut v = vec![1.0f32; 1024];
                pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                if pg.rank() == 2 {
                    std::thread::sleep(std::time::Duration::from_secs(600));
                }
                pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            }
            other => panic!("unknown role {other}"),
        }
    }

    fn collectives(pg: &tandem_comm::ProcessGroup) {
        let (r, n) = (pg.rank(), pg.size());
        assert_eq!(n, 3);
        // Sums over f32, f64, i64 (MPI's types), large enough for several MPI chunks of work.
        let mut a: Vec<f32> = (0..100_003).map(|i| (i % 97) as f32 * (r + 1) as f32).collect();
        pg.all_reduce(&mut a, ReduceOp::Sum).unwrap();
        assert!(a.iter().enumerate().all(|(i, &x)| x == (i % 97) as f32 * 6.0));
        let mut d = vec![r as f64 + 0.5; 7];
        pg.all_reduce(&mut d, ReduceOp::Avg).unwrap();
        assert_eq!(d, vec![1.5; 7]);
        let mut m = vec![r as i64 * 10 - 5, -(r as i64)];
        pg.all_reduce(&mut m, ReduceOp::Max).unwrap();
        assert_eq!(m, [15, 0]);
        let mut m = vec![r as i64 * 10 - 5];
        pg.all_reduce(&mut m, ReduceOp::Min).unwrap();
        assert_eq!(m, [-5]);
        let mut p = vec![(r + 2) as i32];
        pg.all_reduce(&mut p, ReduceOp::Product).unwrap();
        assert_eq!(p, [24]);
        // f16/bf16 have no MPI type: tandem's ring over MPI point-to-point.
        let mut h = vec![half::f16::from_f32(r as f32 + 1.0); 33];
        pg.all_reduce(&mut h, ReduceOp::Sum).unwrap();
        assert!(h.iter().all(|x| x.to_f32() == 6.0));
        let mut b = vec![half::bf16::from_f32(2.0); 5];
        pg.all_reduce(&mut b, ReduceOp::Avg).unwrap();
        assert!(b.iter().all(|x| x.to_f32() == 2.0));
        // Async work, in issue order.
        let w1 = pg.all_reduce_async(vec![1.0f32; 10], ReduceOp::Sum);
        let w2 = pg.broadcast_async(vec![r as f32; 4], 2);
        assert_eq!(w1.wait().unwrap(), vec![3.0; 10]);
        assert_eq!(w2.wait().unwrap(), vec![2.0; 4]);
        // Broadcast, all_gather, reduce_scatter, gather, scatter.
        let mut bc = if r == 1 { vec![7u8, 8, 9] } else { vec![0u8; 3] };
        pg.broadcast(&mut bc, 1).unwrap();
        assert_eq!(bc, [7, 8, 9]);
        let mut all = vec![0f32; 6];
        pg.all_gather(&[r as f32, -(r as f32)], &mut all).unwrap();
        assert_eq!(all, [0.0, -0.0, 1.0, -1.0, 2.0, -2.0]);
        let input: Vec<f32> = (0..6).map(|i| (i + r) as f32).collect();
        let mut mine = vec![0f32; 2];
        pg.reduce_scatter(&input, &mut mine, ReduceOp::Sum).unwrap();
        assert_eq!(mine, [(6 * r + 3) as f32, (6 * r + 6) as f32]);
        let mut gathered = vec![0i64; 3];
        let out = (r == 0).then_some(&mut gathered[..]);
        pg.gather(&[r as i64 * 100], out, 0).unwrap();
        if r == 0 {
            assert_eq!(gathered, [0, 100, 200]);
        }
        let src: Vec<f64> = vec![1.0, 2.0, 3.0];
        let mut got = [0f64];
        pg.scatter((r == 2).then_some(&src[..]), &mut got, 2).unwrap();
        assert_eq!(got[0], (r + 1) as f64);
        // Bytes of different lengths per rank; broadcast of bytes.
        let names = pg.all_gather_bytes("x".repeat(r + 1).as_bytes()).unwrap();
        assert_eq!(names, vec![b"x".to_vec(), b"xx".to_vec(), b"xxx".to_vec()]);
        let mut msg = if r == 0 { b"hello".to_vec() } else { Vec::new() };
        pg.broadcast_bytes(&mut msg, 0).unwrap();
        assert_eq!(msg, b"hello");
        // Point-to-point around the ring.
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        if r % 2 == 0 {
            pg.send(&[r as f32; 3], right).unwrap();
        }
        if r % 2 == 1 || r == 0 {
            let mut got = [0f32; 3];
            pg.recv(&mut got, left).unwrap();
            assert_eq!(got, [left as f32; 3]);
        }
        // Rank 2 sent to 0 above; 1 sends to 2 now.
        if r == 1 {
            pg.send(&[9f32; 3], 2).unwrap();
        }
        if r == 2 {
            let mut got = [0f32; 3];
            pg.recv(&mut got, 1).unwrap();
            assert_eq!(got, [9.0; 3]);
        }
        // A sub-group of ranks 0 and 2 (MPI_Comm_create_group): rank 1 is not in it.
        let sub = pg.new_group(&[0, 2]).unwrap();
        assert_eq!(sub.is_some(), r != 1);
        if let Some(sub) = sub {
            assert_eq!(sub.transport(), Some(TransportKind::Mpi));
            let mut v = vec![r as f32; 4];
            sub.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            assert_eq!(v, [2.0; 4]);
        }
        more_collectives(pg);
        pg.barrier().unwrap();
        println!("OK rank {r}/{n} transport {:?}", pg.transport());
    }

    /// The collectives past the core over MPI: bitwise reductions (MPI's own operators),
    /// reduce, all_to_all with uneven splits, a batched ring shift, object collectives,
    /// monitored_barrier and subgroups (`collectives_more.rs` covers them on tcp and shm).
    fn more_collectives(pg: &tandem_comm::ProcessGroup) {
        let (r, n) = (pg.rank(), pg.size());
        let mut bits = vec![(r as i64 + 1) * 3, 12];
        pg.all_reduce(&mut bits, ReduceOp::BitXor).unwrap();
        assert_eq!(bits, [3 ^ 6 ^ 9, 12]);
        let mut bits = vec![(1i32 << r) | 8];
        pg.all_reduce(&mut bits, ReduceOp::BitOr).unwrap();
        assert_eq!(bits, [15]);
        let mut red = vec![(r + 1) as f32; 5];
        pg.reduce(&mut red, ReduceOp::Sum, 2).unwrap();
        assert_eq!(red, vec![if r == 2 { 6.0 } else { (r + 1) as f32 }; 5]);
        // Rank f sends (f + t) % 3 elements of value 10 f + t to rank t.
        let ins: Vec<usize> = (0..n).map(|t| (r + t) % 3).collect();
        let outs: Vec<usize> = (0..n).map(|f| (f + r) % 3).collect();
        let input: Vec<i64> = (0..n).flat_map(|t| vec![(10 * r + t) as i64; (r + t) % 3]).collect();
        let mut output = vec![0i64; outs.iter().sum()];
        pg.all_to_all_single(&input, &mut output, Some(&ins), Some(&outs)).unwrap();
        let want: Vec<i64> = (0..n).flat_map(|f| vec![(10 * f + r) as i64; (f + r) % 3]).collect();
        assert_eq!(output, want);
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        let ops = vec![
            tandem_comm::P2POp::isend(vec![r as f32; 300_000], right),
            tandem_comm::P2POp::irecv(vec![0f32; 300_000], left),
        ];
        let done = pg.batch_isend_irecv(ops).wait().unwrap();
        assert!(done[1].buf.iter().all(|x| *x == left as f32));
        let names = pg.all_gather_object(&format!("rank-{r}")).unwrap();
        assert_eq!(names, ["rank-0", "rank-1", "rank-2"]);
        let got = pg.gather_object(&(r * 2), 1).unwrap();
        assert_eq!(got, (r == 1).then(|| vec![0, 2, 4]));
        pg.monitored_barrier(Some(std::time::Duration::from_secs(10))).unwrap();
        let single = pg.new_subgroups(Some(1)).unwrap();
        assert_eq!(single.world_ranks(), [r]);
    }
}
