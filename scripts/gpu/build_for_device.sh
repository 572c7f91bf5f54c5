#!/bin/bash
# Builds `tandem` with `--features cuda` on a machine without a GPU or CUDA libraries, for a GPU
# machine that has them (the workplace's device machine: its PyTorch wheels and driver carry
# cuBLAS, cuBLASLt, cuRAND, NVRTC, the runtime and libcuda). nvcc comes from pip (.venv-cuda, as
# .ci/run installs it); the link is made against stub libraries that carry the real libraries'
# sonames and the symbols the binary names, so the loader there binds the real ones.
# Output: .gpu/tandem.xz (small enough to carry). Usage: scripts/gpu/build_for_device.sh [CAP]
set -euo pipefail
cd "$(dirname "$0")/../.."
cap="${1:-90}"   # 90: H100 / H200
cuda_root="$(echo "$PWD"/.venv-cuda/lib/python3*/site-packages/nvidia/cu13)"
[ -x "$cuda_root/bin/nvcc" ] || { echo "no nvcc under $cuda_root (see .ci/run)"; exit 1; }
stubs="$PWD/target-cuda/stubs"
mkdir -p "$stubs" .gpu
ln -sf "$cuda_root/lib/libcudart.so.13" "$stubs/libcudart.so"
touch "$stubs/symbols.txt"
build() {
  PATH="$cuda_root/bin:$PATH" CUDA_HOME="$cuda_root" CUDA_PATH="$cuda_root" CUDA_COMPUTE_CAP="$cap" \
    NVCC_APPEND_FLAGS="-Xcicc -O1 -Xptxas -O0" CARGO_TARGET_DIR=target-cuda \
    CARGO_PROFILE_RELEASE_DEBUG=0 RUSTFLAGS="-L $stubs" \
    cargo build --release -p tandem-cli --features cuda 2>&1
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
    strip -o .gpu/tandem target-cuda/release/tandem
    xz -T0 -6 -f .gpu/tandem
    ls -la .gpu/tandem.xz
    exit 0
  fi
  missing="$(echo "$out" | grep -o 'undefined symbol: [A-Za-z0-9_]*' | awk '{print $3}' | sort -u)"
  [ -n "$missing" ] || { echo "$out" | tail -30; exit 1; }
  echo "$missing" >> "$stubs/symbols.txt"
  sort -u "$stubs/symbols.txt" -o "$stubs/symbols.txt"
done
echo "still unresolved after 8 rounds"; exit 1
