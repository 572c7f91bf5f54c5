// In-place optimizer updates on f32 tensors: torch.optim.SGD (dense, and row-sparse for
// PartialFC's sampled head) and Adam/AdamW. Every element is computed with the same f32
// operations in the same order as the CPU twins (tandem-optim/src/fused/), rounding each step
// (the rules are in optim_rules.cuh, which the host check also compiles), so a GPU step equals
// the CPU step bit for bit.
#include "common.cuh"
#include "optim_rules.cuh"

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

// exp_avg += (d - exp_avg)·(1 - β1)
extern "C" __global__ void adam_first_moment(float* m, const float* g, const float* p, size_t n,
                                             AdamRule k) {
  GRID_STRIDE(i, n) {
    m[i] = adam_first_moment_rule(k, m[i], g[i], p[i]);
  }
}

// exp_avg_sq = β2·exp_avg_sq + (1 - β2)·d²
extern "C" __global__ void adam_second_moment(float* v, const float* g, const float* p, size_t n,
                                              AdamRule k) {
  GRID_STRIDE(i, n) {
    v[i] = adam_second_moment_rule(k, v[i], g[i], p[i]);
  }
}

// amsgrad: max = maximum(max, exp_avg_sq) as candle's maximum (NaN in max is kept).
extern "C" __global__ void adam_running_max(float* mx, const float* v, size_t n) {
  GRID_STRIDE(i, n) { mx[i] = adam_running_max_rule(mx[i], v[i]); }
}

// p = decay(p) - step_size·exp_avg / (sqrt(second)·inv_bc2_sqrt + eps)
extern "C" __global__ void adam_param(float* p, const float* m, const float* s, size_t n,
                                      AdamRule k) {
  GRID_STRIDE(i, n) {
    p[i] = adam_param_rule(k, p[i], m[i], s[i]);
  }
}
