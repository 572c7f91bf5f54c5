//! `tandem train --backend mpi` under a real `mpirun` (OpenMPI): the MPI library's collectives
//! train the same model as tandem's own TCP ring, and a rank killed with SIGKILL ends the job
//! with mpirun naming it. Skipped, with the reason, without the `mpi` feature or mpirun, unless
//! TANDEM_REQUIRE_MPI=1 (CI). Built with `harness = false` for that.
use std::path::Path;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use tandem_testutil::child::Running;
use tandem_testutil::{harness, output_with_deadline, without_world};

const LIMIT: Duration = Duration::from_secs(180);

fn main() -> ExitCode {
    let why = if cfg!(feature = "mpi") {
        harness::mpirun_missing()
    } else {
        Some("built without the `mpi` feature (cargo test -p tandem-cli --features mpi)".into())
    };
    let why = harness::skip_unless_required(why, "TANDEM_REQUIRE_MPI");
    let tests = tandem_testutil::tests![
        mpi_backend_trains_like_the_tcp_ring,
        a_rank_killed_under_mpirun_ends_the_training_job,
    ];
    harness::main_serial(tests.into_iter().map(|t| t.skip_if(why.clone())).collect())
}

/// `mpirun -np N tandem train ARGS` from `dir`.
fn mpirun_train(n: usize, dir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new("mpirun");
    without_world(&mut c);
    c.current_dir(dir);
    c.args(["--allow-run-as-root", "--oversubscribe", "-np", &n.to_string()]);
    // mpirun passes MASTER_PORT on (-x); a free one unless the caller set its own.
    c.env("MASTER_PORT", tandem_testutil::free_port().to_string());
    c.args(["-x", "MASTER_PORT"]);
    c.arg(env!("CARGO_BIN_EXE_tandem")).arg("train").args(args);
    c
}

/// The pid of the process whose environment says it is `rank` of the job on `port`.
fn find_rank(port: &str, rank: usize) -> Option<i32> {
    let want = [format!("MASTER_PORT={port}"), format!("OMPI_COMM_WORLD_RANK={rank}")];
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let env = std::fs::read(e.path().join("environ")).ok()?;
        let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
        want.iter().all(|w| vars.contains(&w.as_bytes())).then_some(pid)
    })
}

fn floats(path: &Path) -> Vec<(String, Vec<f32>)> {
    let v = tandem::ckpt::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    v.as_dict()
        .expect("a state dict")
        .iter()
        .map(|(k, t)| (k.as_str().unwrap().to_string(), t.as_tensor().unwrap().to_f32_vec()))
        .collect()
}

fn mpi_backend_trains_like_the_tcp_ring() {
    let dir = tempfile::tempdir().unwrap();
    let mut finals = Vec::new();
    for backend in ["mpi", "tcp"] {
        let weights = dir.path().join(format!("{backend}.pt"));
        let out = dir.path().join(format!("run-{backend}"));
        let args = [
            "--backend",
            backend,
            "--model",
            "cnn",
            "--steps",
            "12",
            "--out",
            out.to_str().unwrap(),
            "--save-final",
            weights.to_str().unwrap(),
        ];
        let o = output_with_deadline(&mut mpirun_train(3, dir.path(), &args), LIMIT);
        let text =
            format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "--backend {backend} failed:\n{text}");
        assert!(text.contains("final: epochs=0 steps=12"), "{text}");
        finals.push(floats(&weights));
    }
    // Same model from both backends: the reductions sum the same values (in another order).
    let mut worst = 0f32;
    for ((name, a), (_, b)) in finals[0].iter().zip(&finals[1]) {
        let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        worst = worst.max(d);
        assert!(d <= 1e-5, "{name}: mpi and tcp differ by {d}");
    }
    println!("max |mpi - tcp| over all weights: {worst:e}");
}

fn a_rank_killed_under_mpirun_ends_the_training_job() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let args =
        ["--backend", "mpi", "--model", "cnn", "--epochs", "1000", "--out", out.to_str().unwrap()];
    let port = tandem_testutil::free_port().to_string();
    let mut cmd = mpirun_train(3, dir.path(), &args);
    cmd.env("MASTER_PORT", &port);
    let job = Running::spawn(&mut cmd);
    // Rank 1's process: the one whose environment has this job's port and rank 1.
    let start = Instant::now();
    let pid = loop {
        if let Some(p) = find_rank(&port, 1) {
            break p;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "rank 1 never started");
        std::thread::sleep(Duration::from_millis(100));
    };
    std::thread::sleep(Duration::from_secs(2));
    // SAFETY: sends SIGKILL to rank 1's process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let killed_at = Instant::now();
    let done = job.wait(Duration::from_secs(60));
    let t = format!("{}{}", done.stdout, done.stderr);
    let status = done.status.unwrap_or_else(|| panic!("the job did not end within 60 s:\n{t}"));
    let after = done.at - killed_at;
    assert!(!status.success(), "{t}");
    assert!(after < Duration::from_secs(30), "took {after:?} to end:\n{t}");
    assert!(t.contains("rank 1") && (t.contains("signal 9") || t.contains("Killed")), "{t}");
    println!("training job ended {after:?} after rank 1 was killed");
}
