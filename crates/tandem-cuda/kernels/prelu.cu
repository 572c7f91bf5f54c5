// PReLU (y = x where x > 0, else a[c]·x; one slope per channel of dim 1, or one for all),
// forward and backward (tandem-nn's FastPRelu; CPU twin tandem-nn/src/kernels/prelu.rs).
// The slopes' gradient Σ gy·x over x ≤ 0 is two-stage like BatchNorm's sums.
#include "common.cuh"

__device__ __forceinline__ size_t slope_of(size_t i, size_t c, size_t hw) {
  return c == 1 ? 0 : (i / hw) % c;
}

template <typename T>
__device__ void prelu_fwd_impl(const T* x, const float* a, T* y, size_t total, size_t c,
                               size_t hw) {
  GRID_STRIDE(i, total) {
    const float v = to_f(x[i]);
    y[i] = from_f<T>(v > 0.0f ? v : __fmul_rn(v, a[slope_of(i, c, hw)]));
  }
}

template <typename T>
__device__ void prelu_grad_input_impl(const T* x, const T* gy, const float* a, T* gx,
                                      size_t total, size_t c, size_t hw) {
  GRID_STRIDE(i, total) {
    const float g = to_f(gy[i]);
    gx[i] = from_f<T>(to_f(x[i]) > 0.0f ? g : __fmul_rn(g, a[slope_of(i, c, hw)]));
  }
}

// Block (chunk, slope): Σ gy·x over x ≤ 0 among the slope's values in the chunk. A slope's
// values are its planes ([N, C, HW]: plane p belongs to slope p % C), or everything (c == 1).
template <typename T>
__device__ void prelu_grad_partials_impl(const T* x, const T* gy, size_t total, size_t c,
                                         size_t hw, size_t chunk_len, double* partials) {
  const size_t s = blockIdx.y, chunk = blockIdx.x, chunks = gridDim.x;
  const size_t per_slope = total / c;
  const size_t begin = chunk * chunk_len;
  const size_t end = min(per_slope, begin + chunk_len);
  double a = 0.0;
  for (size_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    size_t i = j;
    if (c > 1) {
      const size_t img = j / hw;
      i = (img * c + s) * hw + (j - img * hw);
    }
    const float v = to_f(x[i]);
    if (v <= 0.0f) a += (double)__fmul_rn(v, to_f(gy[i]));
  }
  a = block_sum(a);
  if (threadIdx.x == 0) partials[s * chunks + chunk] = a;
}

// One block per slope: the sum of its partials, in order.
extern "C" __global__ void prelu_grad_slopes(const double* partials, size_t chunks, float* ga) {
  const size_t s = blockIdx.x;
  double a = 0.0;
  for (size_t k = threadIdx.x; k < chunks; k += blockDim.x) a += partials[s * chunks + k];
  a = block_sum(a);
  if (threadIdx.x == 0) ga[s] = (float)a;
}

#define PRELU_KERNELS(SUFFIX, T)                                                              \
  extern "C" __global__ void prelu_fwd_##SUFFIX(const T* x, const float* a, T* y,            \
                                                size_t total, size_t c, size_t hw) {         \
    prelu_fwd_impl<T>(x, a, y, total, c, hw);                                                 \
  }                                                                                           \
  extern "C" __global__ void prelu_grad_input_##SUFFIX(const T* x, const T* gy,              \
                                                       const float* a, T* gx, size_t total,  \
                                                       size_t c, size_t hw) {                \
    prelu_grad_input_impl<T>(x, gy, a, gx, total, c, hw);                                     \
  }                                                                                           \
  extern "C" __global__ void prelu_grad_partials_##SUFFIX(const T* x, const T* gy,           \
                                                          size_t total, size_t c, size_t hw, \
                                                          size_t chunk_len,                  \
                                                          double* partials) {                \
    prelu_grad_partials_impl<T>(x, gy, total, c, hw, chunk_len, partials);                    \
  }

FOR_EACH_TYPE(PRELU_KERNELS)
