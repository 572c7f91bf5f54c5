// In-place optimizer updates on f32 tensors: torch.optim.SGD (dense, and row-sparse for
// PartialFC's sampled head) and Adam/AdamW. Every element is computed with the same f32
// operations in the same order as the CPU twins (tandem-optim/src/fused/), rounding each step
// (`aff(x, m)` is candle's affine, x·m + 0), so a GPU step equals the CPU step bit for bit.
#include "common.cuh"

__device__ __forceinline__ float aff(float x, float m) { return __fadd_rn(__fmul_rn(x, m), 0.0f); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }

struct SgdRule {
  float neg_lr;
  float wd;  // used when has_wd
  float momentum;
  float keep;  // 1 - dampening, used when has_keep
  int has_wd;
  int has_keep;
  int nesterov;
  int use_buf;
};

// The new parameter element (see the CPU twin's with_param_rule).
__device__ __forceinline__ float sgd_param_rule(const SgdRule& k, float p, float g, float b) {
  if (!k.use_buf) {
    const float d = k.has_wd ? add(g, aff(p, k.wd)) : g;
    return add(p, aff(d, k.neg_lr));
  }
  if (!k.nesterov) return add(p, aff(b, k.neg_lr));
  const float d = k.has_wd ? add(add(g, aff(p, k.wd)), aff(b, k.momentum)) : add(g, aff(b, k.momentum));
  return add(p, aff(d, k.neg_lr));
}

// The new momentum buffer element (see with_momentum_rule).
__device__ __forceinline__ float sgd_momentum_rule(const SgdRule& k, int first, float b, float g,
                                                   float p) {
  const float d = k.has_wd ? add(g, aff(p, k.wd)) : g;
  if (first) return d;
  return add(aff(b, k.momentum), k.has_keep ? aff(d, k.keep) : d);
}

extern "C" __global__ void sgd_param(float* p, const float* g, const float* b, size_t n,
                                     SgdRule k) {
  GRID_STRIDE(i, n) { p[i] = sgd_param_rule(k, p[i], g[i], k.use_buf ? b[i] : 0.0f); }
}

extern "C" __global__ void sgd_momentum(float* b, const float* g, const float* p, size_t n,
                                        SgdRule k, int first) {
  GRID_STRIDE(i, n) { b[i] = sgd_momentum_rule(k, first, b[i], g[i], p[i]); }
}

// map[r] = -1 for every row, then map[rows[j]] = j: which gradient row (if any) row r has.
extern "C" __global__ void rows_map_clear(int* map, size_t n_rows) {
  GRID_STRIDE(i, n_rows) { map[i] = -1; }
}
extern "C" __global__ void rows_map_set(const uint32_t* rows, size_t n, int* map) {
  GRID_STRIDE(j, n) { map[rows[j]] = (int)j; }
}

// Row-sparse steps over [n_rows, cols]: the gradient of row r is g_rows[map[r]] or zeros.
__device__ __forceinline__ float row_grad(const float* g_rows, const int* map, size_t i,
                                          size_t cols) {
  const size_t r = i / cols;
  const int j = map[r];
  return j < 0 ? 0.0f : g_rows[(size_t)j * cols + (i - r * cols)];
}

extern "C" __global__ void sgd_param_rows(float* p, const float* g_rows, const float* b,
                                          const int* map, size_t cols, size_t n, SgdRule k) {
  GRID_STRIDE(i, n) {
    p[i] = sgd_param_rule(k, p[i], row_grad(g_rows, map, i, cols), k.use_buf ? b[i] : 0.0f);
  }
}

extern "C" __global__ void sgd_momentum_rows(float* b, const float* g_rows, const float* p,
                                             const int* map, size_t cols, size_t n, SgdRule k,
                                             int first) {
  GRID_STRIDE(i, n) {
    b[i] = sgd_momentum_rule(k, first, first ? 0.0f : b[i], row_grad(g_rows, map, i, cols), p[i]);
  }
}

struct AdamRule {
  float coupled_wd;  // used when has_coupled_wd (Adam's L2 term)
  float decay;       // used when has_decay (AdamW's 1 - lr·wd)
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float inv_bc2_sqrt;
  float eps;
  float neg_step_size;
  int has_coupled_wd;
  int has_decay;
};

// exp_avg += (d - exp_avg)·(1 - β1)
extern "C" __global__ void adam_first_moment(float* m, const float* g, const float* p, size_t n,
                                             AdamRule k) {
  GRID_STRIDE(i, n) {
    const float d = k.has_coupled_wd ? add(g[i], aff(p[i], k.coupled_wd)) : g[i];
    m[i] = add(m[i], aff(__fsub_rn(d, m[i]), k.one_minus_beta1));
  }
}

// exp_avg_sq = β2·exp_avg_sq + (1 - β2)·d²
extern "C" __global__ void adam_second_moment(float* v, const float* g, const float* p, size_t n,
                                              AdamRule k) {
  GRID_STRIDE(i, n) {
    const float d = k.has_coupled_wd ? add(g[i], aff(p[i], k.coupled_wd)) : g[i];
    v[i] = add(aff(v[i], k.beta2), aff(__fmul_rn(d, d), k.one_minus_beta2));
  }
}

// amsgrad: max = maximum(max, exp_avg_sq) as candle's maximum (NaN in max is kept).
extern "C" __global__ void adam_running_max(float* mx, const float* v, size_t n) {
  GRID_STRIDE(i, n) { mx[i] = mx[i] < v[i] ? v[i] : mx[i]; }
}

// p = decay(p) - step_size·exp_avg / (sqrt(second)·inv_bc2_sqrt + eps)
extern "C" __global__ void adam_param(float* p, const float* m, const float* s, size_t n,
                                      AdamRule k) {
  GRID_STRIDE(i, n) {
    const float base = k.has_decay ? aff(p[i], k.decay) : p[i];
    const float denom = add(__fmul_rn(sqrtf(s[i]), k.inv_bc2_sqrt), k.eps);
    p[i] = add(base, aff(__fdiv_rn(m[i], denom), k.neg_step_size));
  }
}
