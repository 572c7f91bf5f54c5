// Row-wise kernels of the face head (one block per row of [rows, k]): L2 normalisation
// (F.normalize, dim 1), the combined margin (ArcFace / CosFace with inter-class filtering)
// and the softmax cross-entropy split over ranks (PartialFC's DistCrossEntropy). CPU twins:
// tandem-nn/src/functional/normalize.rs, tandem-partial-fc/src/{margin,cross_entropy}.rs.
#include "common.cuh"

#define NORMALIZE_EPS 1e-12f

// Σ x² of row r in f32 (the CPU twin's order differs; values agree within rounding).
template <typename T>
__device__ float row_sumsq(const T* x, size_t f) {
  double a = 0.0;
  for (size_t j = threadIdx.x; j < f; j += blockDim.x) {
    const double v = to_f(x[j]);
    a += v * v;
  }
  return (float)block_sum(a);
}

template <typename T>
__device__ void normalize_fwd_impl(const T* x, T* y, size_t f) {
  const size_t r = blockIdx.x;
  const T* xr = x + r * f;
  const float n = fmaxf(sqrtf(row_sumsq(xr, f)), NORMALIZE_EPS);
  for (size_t j = threadIdx.x; j < f; j += blockDim.x) y[r * f + j] = from_f<T>(to_f(xr[j]) / n);
}

// gx = (g − y·(g·y)) / ‖x‖, or g / eps where the norm is clamped.
template <typename T>
__device__ void normalize_bwd_impl(const T* x, const T* y, const T* g, T* gx, size_t f) {
  const size_t r = blockIdx.x;
  const T *xr = x + r * f, *yr = y + r * f, *gr = g + r * f;
  const float norm = sqrtf(row_sumsq(xr, f));
  double dot = 0.0;
  for (size_t j = threadIdx.x; j < f; j += blockDim.x) dot += (double)to_f(gr[j]) * to_f(yr[j]);
  const float gy = (float)block_sum(dot);
  for (size_t j = threadIdx.x; j < f; j += blockDim.x) {
    const float v = norm > NORMALIZE_EPS ? (to_f(gr[j]) - to_f(yr[j]) * gy) / norm
                                         : to_f(gr[j]) / NORMALIZE_EPS;
    gx[r * f + j] = from_f<T>(v);
  }
}

#define NORMALIZE_KERNELS(SUFFIX, T)                                                          \
  extern "C" __global__ void normalize_fwd_##SUFFIX(const T* x, T* y, size_t f) {             \
    normalize_fwd_impl<T>(x, y, f);                                                           \
  }                                                                                           \
  extern "C" __global__ void normalize_bwd_##SUFFIX(const T* x, const T* y, const T* g, T* gx, \
                                                    size_t f) {                              \
    normalize_bwd_impl<T>(x, y, g, gx, f);                                                    \
  }
FOR_EACH_TYPE(NORMALIZE_KERNELS)

struct Margin {
  float s;
  float m2;         // ArcFace's additive angular margin (kind 0)
  float m3;         // CosFace's additive cosine margin (kind 1)
  float threshold;  // inter-class filtering: negatives above it are zeroed (when > 0)
  int kind;
};

// The label's column in this rank's logits, or -1.
__device__ __forceinline__ long long target_of(const long long* labels, size_t r, size_t k) {
  const long long t = labels[r];
  return (t >= 0 && (size_t)t < k) ? t : -1;
}

// Whether (r, j) is zeroed by inter-class filtering.
__device__ __forceinline__ bool filtered(const Margin& m, float v, bool is_target) {
  return m.threshold > 0.0f && v > m.threshold && !is_target;
}

// out = s·margin(x) on f32 logits [n, k] (x already clamped to [-1, 1]).
extern "C" __global__ void margin_fwd(const float* x, const long long* labels, float* out,
                                      size_t k, Margin m) {
  const size_t r = blockIdx.x;
  const long long t = target_of(labels, r, k);
  for (size_t j = threadIdx.x; j < k; j += blockDim.x) {
    const bool is_target = (long long)j == t;
    float v = x[r * k + j];
    if (filtered(m, v, is_target)) v = 0.0f;
    // arcface_torch takes arccos then cos of every logit (the target's with + m2) under
    // no_grad; CosFace subtracts m3 from the target alone.
    if (m.kind == 0) {
      v = cosf(acosf(v) + (is_target ? m.m2 : 0.0f));
    } else if (is_target) {
      v = v - m.m3;
    }
    out[r * k + j] = v * m.s;
  }
}

// The margin's gradient: s where the logit passes (ArcFace's target moves without a gradient
// path, CosFace's by a constant), 0 where filtered.
extern "C" __global__ void margin_bwd(const float* x, const long long* labels, const float* g,
                                      float* gx, size_t k, Margin m) {
  const size_t r = blockIdx.x;
  const long long t = target_of(labels, r, k);
  for (size_t j = threadIdx.x; j < k; j += blockDim.x) {
    const bool drop = filtered(m, x[r * k + j], (long long)j == t);
    gx[r * k + j] = drop ? 0.0f : g[r * k + j] * m.s;
  }
}

// Block reductions of a float by max.
__device__ float block_max(float v) {
  __shared__ float s[TANDEM_BLOCK];
  const unsigned t = threadIdx.x;
  s[t] = v;
  __syncthreads();
  for (unsigned w = TANDEM_BLOCK / 2; w > 0; w >>= 1) {
    if (t < w) s[t] = fmaxf(s[t], s[t + w]);
    __syncthreads();
  }
  const float out = s[0];
  __syncthreads();
  return out;
}

// Stage 1: this rank's row maxima.
extern "C" __global__ void ce_row_max(const float* x, size_t k, float* max) {
  const size_t r = blockIdx.x;
  float v = -INFINITY;
  for (size_t j = threadIdx.x; j < k; j += blockDim.x) v = fmaxf(v, x[r * k + j]);
  v = block_max(v);
  if (threadIdx.x == 0) max[r] = v;
}

// Stage 2: p = exp(x − max) (the world's max) and this rank's row sums of p.
extern "C" __global__ void ce_exp_sum(const float* x, const float* max, size_t k, float* p,
                                      float* sums) {
  const size_t r = blockIdx.x;
  double a = 0.0;
  for (size_t j = threadIdx.x; j < k; j += blockDim.x) {
    const float e = expf(x[r * k + j] - max[r]);
    p[r * k + j] = e;
    a += e;
  }
  a = block_sum(a);
  if (threadIdx.x == 0) sums[r] = (float)a;
}

// Stage 3: p /= the world's row sum; target[r] = p at the label's column here (0 elsewhere).
extern "C" __global__ void ce_normalize(float* p, const float* sums, const long long* labels,
                                        size_t k, float* target) {
  const size_t r = blockIdx.x;
  const long long t = target_of(labels, r, k);
  for (size_t j = threadIdx.x; j < k; j += blockDim.x) p[r * k + j] /= sums[r];
  __syncthreads();
  if (threadIdx.x == 0) target[r] = t >= 0 ? p[r * k + t] : 0.0f;
}

// Stage 4 (one block): loss = −mean_r log(max(target[r], 1e-30)) over the n rows.
extern "C" __global__ void ce_loss(const float* target, size_t n, float* loss) {
  double a = 0.0;
  for (size_t r = threadIdx.x; r < n; r += blockDim.x) a += logf(fmaxf(target[r], 1e-30f));
  a = block_sum(a);
  if (threadIdx.x == 0) loss[0] = (float)(-a / (double)n);
}

// Backward: gx = (p − onehot(label))·g/n, g the loss's gradient (a device scalar).
extern "C" __global__ void ce_bwd(const float* p, const long long* labels, const float* g,
                                  size_t n, size_t k, float* gx) {
  const size_t r = blockIdx.x;
  const long long t = target_of(labels, r, k);
  const float scale = g[0] / (float)n;
  for (size_t j = threadIdx.x; j < k; j += blockDim.x) {
    const float d = (long long)j == t ? p[r * k + j] - 1.0f : p[r * k + j];
    gx[r * k + j] = d * scale;
  }
}
