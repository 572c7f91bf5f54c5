// Sums over many tensors with one read-back: each tensor's Σ x² (f64) lands in its slot of a
// device buffer (fixed grid, partials added in order), and `sum_slots` totals the slots, so
// clip_grad_norm reads one f64 from the device for the whole model, not one per parameter.
#include "common.cuh"

#define SUMSQ_BLOCKS 64

// Block b of SUMSQ_BLOCKS: Σ x² over its stride of x, into partials[b].
template <typename T>
__device__ void sumsq_partials_impl(const T* x, size_t n, double* partials) {
  double a = 0.0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const double v = to_f(x[i]);
    a += v * v;
  }
  a = block_sum(a);
  if (threadIdx.x == 0) partials[blockIdx.x] = a;
}

#define SUMSQ_KERNELS(SUFFIX, T)                                                            \
  extern "C" __global__ void sumsq_partials_##SUFFIX(const T* x, size_t n, double* partials) { \
    sumsq_partials_impl<T>(x, n, partials);                                                 \
  }
FOR_EACH_TYPE(SUMSQ_KERNELS)

// One block: out[0] = Σ partials[0..n), in order of the block tree.
extern "C" __global__ void sum_slots(const double* partials, size_t n, double* out) {
  double a = 0.0;
  for (size_t k = threadIdx.x; k < n; k += blockDim.x) a += partials[k];
  a = block_sum(a);
  if (threadIdx.x == 0) out[0] = a;
}

// Any non-finite value in x: flag[0] = 1 (never cleared here). GradScaler's found_inf for a
// whole model with one read-back.
template <typename T>
__device__ void any_nonfinite_impl(const T* x, size_t n, int* flag) {
  GRID_STRIDE(i, n) {
    if (!isfinite(to_f(x[i]))) flag[0] = 1;
  }
}
#define NONFINITE_KERNELS(SUFFIX, T)                                                         \
  extern "C" __global__ void any_nonfinite_##SUFFIX(const T* x, size_t n, int* flag) {       \
    any_nonfinite_impl<T>(x, n, flag);                                                       \
  }
FOR_EACH_TYPE(NONFINITE_KERNELS)
