//! The NCCL backend (feature `nccl`) on any machine: loading libnccl from pip's wheel, a clear
//! error when it is missing, the store rendezvous naming a rank that never joins, and init on
//! the device — which fails with CUDA's reason where there is no GPU, and where there is one
//! makes a communicator that runs a barrier. Skipped, with the reason, without the feature or
//! without libnccl (pip's `nvidia-nccl-cu13`, which torch's CUDA wheels pull in), unless
//! TANDEM_REQUIRE_NCCL=1 (CI), which makes a missing library a failure.
use std::process::{Command, ExitCode};
use std::time::Duration;

use tandem_testutil::harness;

const ROLE: &str = "TANDEM_NCCL_TEST_ROLE";

fn main() -> ExitCode {
    if let Ok(role) = std::env::var(ROLE) {
        #[cfg(feature = "nccl")]
        return roles::run(&role);
        #[cfg(not(feature = "nccl"))]
        panic!("role {role} needs the nccl feature");
    }
    let why = harness::skip_unless_required(unavailable(), "TANDEM_REQUIRE_NCCL");
    let tests = tandem_testutil::tests![
        nccl_is_found_in_pip_s_wheel_and_reports_its_version,
        a_missing_nccl_names_where_it_looked_and_what_to_install,
        a_rank_that_never_joins_nccl_is_named_within_the_timeout,
        nccl_init_fails_with_cuda_s_reason_without_a_gpu_and_runs_a_barrier_with_one,
    ];
    harness::main_serial(tests.into_iter().map(|t| t.skip_if(why.clone())).collect())
}

fn unavailable() -> Option<String> {
    #[cfg(not(feature = "nccl"))]
    return Some(
        "built without the `nccl` feature (cargo test -p tandem-comm --features nccl)".into(),
    );
    #[cfg(feature = "nccl")]
    tandem_comm::nccl::nccl_library().err().map(|e| e.to_string())
}

/// A GPU that this process could use (the NVIDIA driver's device node).
#[cfg(feature = "nccl")]
fn has_gpu() -> bool {
    std::path::Path::new("/dev/nvidia0").exists()
}

fn nccl_is_found_in_pip_s_wheel_and_reports_its_version() {
    #[cfg(feature = "nccl")]
    {
        let info = tandem_comm::nccl::nccl_library().unwrap();
        // ncclCommInitRankConfig, which tandem needs, arrived in NCCL 2.14.
        assert!(info.version >= 21400, "NCCL {} is too old", info.version_string());
        assert!(info.nccl.contains("libnccl.so"), "{info:?}");
        assert!(info.cudart.contains("libcudart.so"), "{info:?}");
        println!(
            "NCCL {} from {}, CUDA runtime from {}",
            info.version_string(),
            info.nccl,
            info.cudart
        );
    }
}

/// A child process (library loading is once per process) pointed at a file that is not there.
fn a_missing_nccl_names_where_it_looked_and_what_to_install() {
    let out = tandem_testutil::output_with_deadline(
        tandem_testutil::without_world(&mut Command::new(std::env::current_exe().unwrap()))
            .env(ROLE, "missing-library")
            .env("TANDEM_NCCL_LIBRARY", "/nonexistent/tandem-test/libnccl.so.2"),
        Duration::from_secs(60),
    );
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(3), "the child must report the error and exit 3: {text}");
    assert!(!text.contains("panicked"), "{text}");
    for needle in [
        "/nonexistent/tandem-test/libnccl.so.2",
        "pip install nvidia-nccl-cu13",
        "TANDEM_NCCL_LIBRARY",
    ] {
        assert!(text.contains(needle), "the error must mention {needle:?}: {text}");
    }
}

fn a_rank_that_never_joins_nccl_is_named_within_the_timeout() {
    #[cfg(feature = "nccl")]
    {
        let mut opts = tandem_testutil::world::test_options(tandem_comm::TransportKind::Tcp);
        opts.timeout = Duration::from_secs(2);
        let started = std::time::Instant::now();
        let results = tandem_testutil::world::run_world(2, opts, Duration::from_secs(60), |pg| {
            if pg.rank() == 0 {
                Some(pg.nccl(0).map(|_| ()).map_err(|e| e.to_string()))
            } else {
                std::thread::sleep(Duration::from_secs(4)); // alive, but never calls nccl()
                None
            }
        });
        let err = results[0].clone().unwrap().expect_err("rank 0 cannot make a communicator alone");
        assert!(err.contains("rank(s) 1 did not reach the NCCL rendezvous"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
    }
}

fn nccl_init_fails_with_cuda_s_reason_without_a_gpu_and_runs_a_barrier_with_one() {
    #[cfg(feature = "nccl")]
    {
        let pg = tandem_comm::init_from(&tandem_comm::InitMethod::Env).unwrap();
        assert_eq!(pg.size(), 1, "run outside a launcher");
        match pg.nccl(0) {
            Ok(comm) if has_gpu() => {
                comm.barrier().expect("a barrier of one rank");
                assert_eq!(comm.device(), 0);
            }
            Ok(_) => panic!("a communicator was made without a GPU"),
            Err(e) if !has_gpu() => {
                let msg = e.to_string();
                assert!(msg.contains("cudaSetDevice") && msg.contains("CUDA error"), "{msg}");
            }
            Err(e) => panic!("a GPU is present but NCCL init failed: {e}"),
        }
    }
}

#[cfg(feature = "nccl")]
mod roles {
    use std::process::ExitCode;

    pub fn run(role: &str) -> ExitCode {
        match role {
            "missing-library" => {
                let pg = tandem_comm::init().expect("a world of one");
                match pg.nccl(0) {
                    Ok(_) => {
                        eprintln!("a communicator was made without libnccl");
                        ExitCode::from(2)
                    }
                    Err(e) => {
                        eprintln!("error: {e}");
                        ExitCode::from(3)
                    }
                }
            }
            other => panic!("unknown role {other}"),
        }
    }
}
