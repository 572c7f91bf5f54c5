//! Under a real Slurm (scripts/slurm_cluster.sh starts a one-node cluster; CI does): `srun`
//! starts the ranks and tandem reads Slurm's variables — `tandem check`, `tandem train`, and an
//! `sbatch` script like the README's. Without a cluster the tests are reported as skipped with
//! the reason, unless TANDEM_REQUIRE_SLURM=1 (CI), which makes a missing cluster a failure.
//! Built with `harness = false` for that.
use std::path::Path;
use std::process::{Command, ExitCode};
use std::time::Duration;

use tandem_testutil::{harness, output_with_deadline, without_world};

const LIMIT: Duration = Duration::from_secs(180);

fn main() -> ExitCode {
    let why = harness::skip_unless_required(unavailable(), "TANDEM_REQUIRE_SLURM");
    let tests = tandem_testutil::tests![
        srun_two_tasks_pass_tandem_check,
        srun_trains_and_every_task_takes_its_rank_from_slurm,
        an_sbatch_script_like_the_readme_trains,
    ];
    harness::main_serial(tests.into_iter().map(|t| t.skip_if(why.clone())).collect())
}

/// Why no cluster can be used here, if so.
fn unavailable() -> Option<String> {
    let out = Command::new("sinfo").args(["-h", "-o", "%T"]).output();
    match out {
        Err(e) => Some(format!(
            "sinfo cannot run ({e}): no Slurm here (sudo scripts/slurm_cluster.sh start)"
        )),
        Ok(o) if !o.status.success() => Some(format!(
            "sinfo failed: {} (sudo scripts/slurm_cluster.sh start)",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Ok(o) => {
            let states = String::from_utf8_lossy(&o.stdout).to_string();
            let usable = states.lines().any(|s| s.starts_with("idle") || s.starts_with("mix"));
            (!usable).then(|| format!("no idle Slurm node (sinfo says {:?})", states.trim()))
        }
    }
}

fn tandem() -> &'static str {
    env!("CARGO_BIN_EXE_tandem")
}

/// A command with no world inherited from an outer launcher, run in `dir`.
fn slurm_cmd(program: &str, dir: &Path) -> Command {
    let mut c = Command::new(program);
    without_world(&mut c);
    c.current_dir(dir);
    c
}

fn run_ok(c: &mut Command, what: &str) -> (String, String) {
    let o = output_with_deadline(c, LIMIT);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(o.status.success(), "{what} failed ({:?})\nstdout:\n{out}\nstderr:\n{err}", o.status);
    (out, err)
}

fn srun_two_tasks_pass_tandem_check() {
    let dir = tempfile::tempdir().unwrap();
    let (out, _) = run_ok(
        slurm_cmd("srun", dir.path()).args(["-N1", "-n2", "--time=2", tandem(), "check"]),
        "srun -N1 -n2 tandem check",
    );
    let mut ranks: Vec<&str> = out.lines().filter(|l| l.ends_with(" ok")).collect();
    ranks.sort();
    assert_eq!(ranks.len(), 2, "{out}");
    assert!(ranks[0].starts_with("rank 0/2 local 0/2"), "{out}");
    assert!(ranks[1].starts_with("rank 1/2 local 1/2"), "{out}");
}

fn srun_trains_and_every_task_takes_its_rank_from_slurm() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let (out, _) = run_ok(
        slurm_cmd("srun", dir.path())
            .args(["-N1", "-n2", "--time=5", tandem(), "train", "--epochs", "1", "--out"])
            .arg(&run),
        "srun -N1 -n2 tandem train",
    );
    let finals: Vec<&str> = out.lines().filter(|l| l.starts_with("final: ")).collect();
    assert_eq!(finals.len(), 1, "only rank 0 prints the summary:\n{out}");
    // 1500 digits over 2 ranks, 32 per rank per step: 24 steps, so both tasks trained together.
    assert!(finals[0].contains("steps=24"), "{}", finals[0]);
    let ck = run.join("checkpoints/checkpoint-step-00000024.pt");
    let v = tandem::ckpt::load(&ck).unwrap_or_else(|e| panic!("{}: {e}", ck.display()));
    assert_eq!(v.get("world_size").and_then(|w| w.as_int()), Some(2));
}

fn an_sbatch_script_like_the_readme_trains() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("train.sbatch");
    let run = dir.path().join("run");
    std::fs::write(
        &script,
        format!(
            "#!/bin/bash\n\
             #SBATCH --job-name=tandem-train\n\
             #SBATCH --nodes=1\n\
             #SBATCH --ntasks-per-node=2\n\
             #SBATCH --time=10\n\
             #SBATCH --output={out}/slurm-%j.out\n\
             srun {tandem} train --epochs 2 --out {run} --save-every 10\n",
            out = dir.path().display(),
            tandem = tandem(),
            run = run.display()
        ),
    )
    .unwrap();
    run_ok(slurm_cmd("sbatch", dir.path()).arg("--wait").arg(&script), "sbatch --wait");
    let log = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .find(|e| e.file_name().to_string_lossy().starts_with("slurm-"))
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .expect("the job's output file");
    assert!(log.contains("final: epochs=2 steps=48"), "job output:\n{log}");
}
