//! With feature `cuda`: compiles each `kernels/*.cu` to PTX with nvcc, into OUT_DIR, for the
//! architecture CUDA_COMPUTE_CAP names (as candle's kernels are built; e.g. 90 for H100/H200).
//! PTX is JIT-compiled by the driver for the GPU at hand, at full optimisation, and cached by
//! it. Without the feature nothing is built and no CUDA toolkit is needed.
use std::path::{Path, PathBuf};
use std::process::Command;

const KERNELS: &[&str] = &["batch_norm", "prelu", "optim", "reduce", "rows"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for var in ["CUDA_COMPUTE_CAP", "NVCC", "CUDA_HOME", "CUDA_PATH", "NVCC_APPEND_FLAGS"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = nvcc();
    let cap = compute_cap(&nvcc);
    for name in KERNELS {
        let src = Path::new("kernels").join(format!("{name}.cu"));
        let ptx = out.join(format!("{name}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", "--expt-relaxed-constexpr"])
            .arg(format!("-arch=compute_{cap}"))
            .arg("-Ikernels")
            .arg(&src)
            .arg("-o")
            .arg(&ptx)
            .status()
            .unwrap_or_else(|e| panic!("tandem-cuda: could not run {}: {e}", nvcc.display()));
        assert!(status.success(), "tandem-cuda: nvcc failed on {}", src.display());
    }
}

/// nvcc from NVCC, CUDA_HOME / CUDA_PATH, or PATH.
fn nvcc() -> PathBuf {
    if let Some(p) = std::env::var_os("NVCC") {
        return PathBuf::from(p);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            let p = Path::new(&root).join("bin/nvcc");
            if p.exists() {
                return p;
            }
        }
    }
    PathBuf::from("nvcc")
}

/// CUDA_COMPUTE_CAP ("90", "8.0", "90a" -> 90), or the first GPU's (nvidia-smi), or 80.
fn compute_cap(_nvcc: &Path) -> u32 {
    let digits = |s: &str| s.chars().filter(char::is_ascii_digit).collect::<String>().parse().ok();
    if let Ok(v) = std::env::var("CUDA_COMPUTE_CAP") {
        if let Some(cap) = digits(&v) {
            return cap;
        }
        panic!("tandem-cuda: CUDA_COMPUTE_CAP={v} is not a compute capability (e.g. 90)");
    }
    let smi = Command::new("nvidia-smi")
        .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok());
    smi.as_deref().and_then(|s| s.lines().next()).and_then(digits).unwrap_or(80)
}
