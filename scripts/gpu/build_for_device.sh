#!/bin/bash
# Builds tandem's `cuda` binaries on a machine without a GPU or CUDA libraries, for a GPU machine
# that has them (the workplace's device machine: its PyTorch wheels and driver carry cuBLAS,
# cuBLASLt, cuRAND, NVRTC, the runtime, cuDNN and libcuda). nvcc comes from pip (.venv-cuda, as
# .ci/run installs it); the link is made against stub libraries that carry the real libraries'
# sonames and the symbols the binaries name, so the loader there binds the real ones. cuDNN and
# NCCL need no stub: tandem loads them at run time.
#
# Kernels are compiled at full optimisation for CAP (90: H100 / H200) as PTX, which the driver
# turns into machine code for the GPU at hand (CI's NVCC_APPEND_FLAGS="-Xcicc -O1 -Xptxas -O0"
# shortcut is for compile checks only; pass --quick to use it here too).
# Output in .gpu/ (small enough to carry): tandem.xz, tandem-bench.xz (`tandem bench` runs it
# from beside tandem) and cuda_twins.xz (crates/tandem/tests/cuda_twins.rs), for
# scripts/gpu/validate.sh. Usage: scripts/gpu/build_for_device.sh [--quick] [CAP]
set -euo pipefail
cd "$(dirname "$0")/../.."
quick=""
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
cap="${1:-90}"
cuda_root="$(echo "$PWD"/.venv-cuda/lib/python3*/site-packages/nvidia/cu13)"
[ -x "$cuda_root/bin/nvcc" ] || { echo "no nvcc under $cuda_root (see .ci/run)"; exit 1; }
stubs="$PWD/target-cuda/stubs"
mkdir -p "$stubs" .gpu
ln -sf "$cuda_root/lib/libcudart.so.13" "$stubs/libcudart.so"
touch "$stubs/symbols.txt"
nvcc_flags=""
[ -n "$quick" ] && nvcc_flags="-Xcicc -O1 -Xptxas -O0"
cargo_env() {
  env PATH="$cuda_root/bin:$PATH" CUDA_HOME="$cuda_root" CUDA_PATH="$cuda_root" \
    CUDA_COMPUTE_CAP="$cap" NVCC_APPEND_FLAGS="$nvcc_flags" CARGO_TARGET_DIR=target-cuda \
    CARGO_PROFILE_RELEASE_DEBUG=0 RUSTFLAGS="-L $stubs" "$@"
}
build() {
  cargo_env cargo build --release -p tandem-cli -p tandem-bench --features tandem-cli/cuda,tandem-bench/cuda 2>&1 &&
    cargo_env cargo test --release -p tandem --features cuda --test cuda_twins --no-run \
      --message-format=json 2>/dev/null > target-cuda/twins.json
}
for attempt in 1 2 3 4 5 6 7 8; do
  # One stub per library: lib NAME, its soname, the symbol prefix it answers for.
  for spec in "cuda libcuda.so.1 ^cu[A-Z]" "nvrtc libnvrtc.so.13 ^nvrtc" \
              "curand libcurand.so.10 ^curand" "cublas libcublas.so.13 ^cublas[A-Z_]" \
              "cublasLt libcublasLt.so.13 ^cublasLt"; do
    set -- $spec
    { grep -E "$3" "$stubs/symbols.txt" || true; } | { [ "$1" = cublas ] && grep -v '^cublasLt' || cat; } \
      | sed 's/.*/void &(void){}/' > "$stubs/$1.c"
    cc -shared -fPIC -o "$stubs/lib$1.so" -Wl,-soname,"$2" "$stubs/$1.c"
  done
  if out="$(build)"; then
    twins="$(grep -o '"executable":"[^"]*cuda_twins[^"]*"' target-cuda/twins.json | tail -1 | cut -d'"' -f4)"
    [ -x "$twins" ] || { echo "no cuda_twins test binary in target-cuda/twins.json"; exit 1; }
    for bin in target-cuda/release/tandem target-cuda/release/tandem-bench "$twins"; do
      name="$(basename "$bin" | sed 's/-[0-9a-f]\{16\}$//')"
      strip -o ".gpu/$name" "$bin"
      xz -T0 -6 -f ".gpu/$name"
    done
    ls -la .gpu/
    exit 0
  fi
  missing="$(echo "$out" | grep -o 'undefined symbol: [A-Za-z0-9_]*' | awk '{print $3}' | sort -u)"
  [ -n "$missing" ] || { echo "$out" | tail -30; exit 1; }
  echo "$missing" >> "$stubs/symbols.txt"
  sort -u "$stubs/symbols.txt" -o "$stubs/symbols.txt"
done
echo "still unresolved after 8 rounds"; exit 1
