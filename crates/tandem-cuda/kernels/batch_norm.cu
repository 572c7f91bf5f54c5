// BatchNorm2d in training mode on [N, C, H, W] tensors, forward and backward, with an optional
// ReLU and residual add (tandem-nn's fused BatchNorm ops; the CPU twins are in
// tandem-nn/src/kernels/batch_norm.rs and compute the same formulas).
//
// Statistics: per channel, sums over (chunk, channel) blocks written as f64 partials, then one
// block per channel adds its partials in order: mean, biased variance, 1/sqrt(var + eps).
// Backward: the same two stages for Σ g and Σ g·(x − mean) (g is the output gradient, zero where
// the output is not positive when a ReLU follows), then one elementwise pass for the input
// gradient, gx = γ·invstd·(g − mean(g) − (x − mean)·invstd·mean(g·x̂)), PyTorch's formula.
#include "common.cuh"

// Position j of a channel's N·HW values -> its offset in [N, C, HW].
__device__ __forceinline__ size_t channel_offset(size_t j, size_t ch, size_t c, size_t hw) {
  const size_t img = j / hw;
  return (img * c + ch) * hw + (j - img * hw);
}

// Block (chunk, ch): two sums of `terms(i, a, b)` over the channel's positions
// [chunk·len, (chunk+1)·len), into partials[ch][chunk][0..2].
template <typename Terms>
__device__ void channel_partials(const Terms& terms, size_t n, size_t c, size_t hw,
                                 size_t chunk_len, double* partials) {
  const size_t ch = blockIdx.y, chunk = blockIdx.x, chunks = gridDim.x;
  const size_t m = n * hw;
  const size_t begin = chunk * chunk_len;
  const size_t end = min(m, begin + chunk_len);
  double a = 0.0, b = 0.0;
  for (size_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    terms(channel_offset(j, ch, c, hw), ch, a, b);
  }
  block_sum2(a, b);
  if (threadIdx.x == 0) {
    partials[(ch * chunks + chunk) * 2] = a;
    partials[(ch * chunks + chunk) * 2 + 1] = b;
  }
}

// One block per channel: the channel's partials added in order (thread 0 holds the totals).
__device__ __forceinline__ void channel_totals(const double* partials, size_t chunks, double& a,
                                               double& b) {
  const size_t ch = blockIdx.x;
  a = 0.0;
  b = 0.0;
  for (size_t k = threadIdx.x; k < chunks; k += blockDim.x) {
    a += partials[(ch * chunks + k) * 2];
    b += partials[(ch * chunks + k) * 2 + 1];
  }
  block_sum2(a, b);
}

// The statistics' terms: x and x².
template <typename T>
struct StatsTerms {
  const T* x;
  __device__ void operator()(size_t i, size_t, double& a, double& b) const {
    const double v = to_f(x[i]);
    a += v;
    b += v * v;
  }
};

template <typename T>
__device__ void bn_partials_impl(const T* x, size_t n, size_t c, size_t hw, size_t chunk_len,
                                 double* partials) {
  channel_partials(StatsTerms<T>{x}, n, c, hw, chunk_len, partials);
}

// One block per channel: stats[0][ch] = mean, stats[1][ch] = biased variance,
// stats[2][ch] = 1/sqrt(var + eps) (as f32, from the f32 variance, as the CPU twin rounds).
extern "C" __global__ void bn_stats(const double* partials, size_t chunks, size_t count,
                                    double eps, size_t c, float* stats) {
  const size_t ch = blockIdx.x;
  double a, b;
  channel_totals(partials, chunks, a, b);
  if (threadIdx.x == 0) {
    const double m = count > 0 ? (double)count : 1.0;
    const double mean = a / m;
    const double var = fmax(b / m - mean * mean, 0.0);
    const float var32 = (float)var;
    stats[ch] = (float)mean;
    stats[c + ch] = var32;
    stats[2 * c + ch] = (float)(1.0 / sqrt((double)var32 + eps));
  }
}

// y = x·scale + shift (+ residual) (then max(·, 0) when relu), scale = γ·invstd,
// shift = β − mean·scale.
template <typename T>
__device__ void bn_apply_impl(const T* x, const float* gamma, const float* beta,
                              const float* stats, const T* residual, int relu, T* y, size_t total,
                              size_t c, size_t hw) {
  const float* mean = stats;
  const float* invstd = stats + 2 * c;
  GRID_STRIDE(i, total) {
    const size_t ch = (i / hw) % c;
    const float scale = __fmul_rn(gamma[ch], invstd[ch]);
    const float shift = __fsub_rn(beta[ch], __fmul_rn(mean[ch], scale));
    float v = __fadd_rn(__fmul_rn(to_f(x[i]), scale), shift);
    if (residual != nullptr) v = __fadd_rn(v, to_f(residual[i]));
    if (relu) v = fmaxf(v, 0.0f);
    y[i] = from_f<T>(v);
  }
}

// The output gradient past the ReLU (zero where the output is not positive), or as it is.
template <typename T>
__device__ __forceinline__ float masked(const T* gy, const T* y, size_t i) {
  const float g = to_f(gy[i]);
  if (y == nullptr) return g;
  return to_f(y[i]) > 0.0f ? g : 0.0f;
}

// The backward's terms: g and g·(x − mean), g the output gradient past the ReLU.
template <typename T>
struct GradTerms {
  const T* x;
  const T* gy;
  const T* y;
  const float* stats;
  __device__ void operator()(size_t i, size_t ch, double& a, double& b) const {
    const float g = masked(gy, y, i);
    a += g;
    b += (double)__fmul_rn(g, __fsub_rn(to_f(x[i]), stats[ch]));
  }
};

template <typename T>
__device__ void bn_grad_partials_impl(const T* x, const T* gy, const T* y, const float* stats,
                                      size_t n, size_t c, size_t hw, size_t chunk_len,
                                      double* partials) {
  channel_partials(GradTerms<T>{x, gy, y, stats}, n, c, hw, chunk_len, partials);
}

// One block per channel: coeffs[0] = gγ = invstd·Σ g(x − mean), coeffs[1] = gβ = Σ g,
// coeffs[2] = k = γ·invstd, coeffs[3] = mean(g), coeffs[4] = slope = invstd·mean(g·x̂).
extern "C" __global__ void bn_grad_coeffs(const double* partials, size_t chunks, size_t count,
                                          const float* stats, const float* gamma, size_t c,
                                          float* coeffs) {
  const size_t ch = blockIdx.x;
  double a, b;
  channel_totals(partials, chunks, a, b);
  if (threadIdx.x == 0) {
    const double m = count > 0 ? (double)count : 1.0;
    const float invstd = stats[2 * c + ch];
    const float mean_g = (float)(a / m);
    const float mean_gx = __fmul_rn((float)(b / m), invstd);
    coeffs[ch] = (float)(b * (double)invstd);
    coeffs[c + ch] = (float)a;
    coeffs[2 * c + ch] = __fmul_rn(gamma[ch], invstd);
    coeffs[3 * c + ch] = mean_g;
    coeffs[4 * c + ch] = __fmul_rn(invstd, mean_gx);
  }
}

// gx = k·(g − mean(g) − (x − mean)·slope); gres = g (the residual's gradient) when asked.
template <typename T>
__device__ void bn_grad_input_impl(const T* x, const T* gy, const T* y, const float* stats,
                                   const float* coeffs, T* gx, T* gres, size_t total, size_t c,
                                   size_t hw) {
  GRID_STRIDE(i, total) {
    const size_t ch = (i / hw) % c;
    const float g = masked(gy, y, i);
    if (gres != nullptr) gres[i] = from_f<T>(g);
    if (gx != nullptr) {
      const float k = coeffs[2 * c + ch], mean_g = coeffs[3 * c + ch];
      const float slope = coeffs[4 * c + ch];
      const float centred = __fsub_rn(to_f(x[i]), stats[ch]);
      const float v = __fmul_rn(k, __fsub_rn(__fsub_rn(g, mean_g), __fmul_rn(centred, slope)));
      gx[i] = from_f<T>(v);
    }
  }
}

#define BN_KERNELS(SUFFIX, T)                                                                   \
  extern "C" __global__ void bn_partials_##SUFFIX(const T* x, size_t n, size_t c, size_t hw,   \
                                                  size_t chunk_len, double* partials) {        \
    bn_partials_impl<T>(x, n, c, hw, chunk_len, partials);                                     \
  }                                                                                             \
  extern "C" __global__ void bn_apply_##SUFFIX(const T* x, const float* gamma,                 \
                                               const float* beta, const float* stats,          \
                                               const T* residual, int relu, T* y,              \
                                               size_t total, size_t c, size_t hw) {            \
    bn_apply_impl<T>(x, gamma, beta, stats, residual, relu, y, total, c, hw);                  \
  }                                                                                             \
  extern "C" __global__ void bn_grad_partials_##SUFFIX(                                        \
      const T* x, const T* gy, const T* y, const float* stats, size_t n, size_t c, size_t hw,  \
      size_t chunk_len, double* partials) {                                                     \
    bn_grad_partials_impl<T>(x, gy, y, stats, n, c, hw, chunk_len, partials);                  \
  }                                                                                             \
  extern "C" __global__ void bn_grad_input_##SUFFIX(                                           \
      const T* x, const T* gy, const T* y, const float* stats, const float* coeffs, T* gx,     \
      T* gres, size_t total, size_t c, size_t hw) {                                            \
    bn_grad_input_impl<T>(x, gy, y, stats, coeffs, gx, gres, total, c, hw);                    \
  }

FOR_EACH_TYPE(BN_KERNELS)
