// The element rules of tandem's in-place optimizer kernels (optim.cu), written once for the GPU
// and for the host: nvcc compiles them into the kernels, and a plain C++ compiler compiles them
// into the host check (host/optim_rules.cpp), which tandem-optim's tests run against the CPU
// optimizers bit for bit — so CI checks the kernels' arithmetic without a GPU.
//
// Each step rounds as the CPU twin does: on the device through the _rn intrinsics (nvcc would
// otherwise contract a*b+c into one fma), on the host by plain float operations compiled with
// -ffp-contract=off. `aff(x, m)` is candle's affine, x·m + 0.
#pragma once

#ifdef __CUDACC__
#define TANDEM_HD __host__ __device__ __forceinline__
#else
#define TANDEM_HD static inline
#include <math.h>
#endif

TANDEM_HD float rn_add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TANDEM_HD float rn_sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
TANDEM_HD float rn_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TANDEM_HD float rn_div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
TANDEM_HD float aff(float x, float m) { return rn_add(rn_mul(x, m), 0.0f); }

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

// The new parameter element (the CPU twin's with_param_rule).
TANDEM_HD float sgd_param_rule(const SgdRule& k, float p, float g, float b) {
  if (!k.use_buf) {
    const float d = k.has_wd ? rn_add(g, aff(p, k.wd)) : g;
    return rn_add(p, aff(d, k.neg_lr));
  }
  if (!k.nesterov) return rn_add(p, aff(b, k.neg_lr));
  const float d = k.has_wd ? rn_add(rn_add(g, aff(p, k.wd)), aff(b, k.momentum))
                           : rn_add(g, aff(b, k.momentum));
  return rn_add(p, aff(d, k.neg_lr));
}

// The new momentum buffer element (with_momentum_rule; `first`: the buffer is d itself).
TANDEM_HD float sgd_momentum_rule(const SgdRule& k, int first, float b, float g, float p) {
  const float d = k.has_wd ? rn_add(g, aff(p, k.wd)) : g;
  if (first) return d;
  return rn_add(aff(b, k.momentum), k.has_keep ? aff(d, k.keep) : d);
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

TANDEM_HD float adam_grad(const AdamRule& k, float g, float p) {
  return k.has_coupled_wd ? rn_add(g, aff(p, k.coupled_wd)) : g;
}

// exp_avg += (d - exp_avg)·(1 - β1)
TANDEM_HD float adam_first_moment_rule(const AdamRule& k, float m, float g, float p) {
  return rn_add(m, aff(rn_sub(adam_grad(k, g, p), m), k.one_minus_beta1));
}

// exp_avg_sq = β2·exp_avg_sq + (1 - β2)·d²
TANDEM_HD float adam_second_moment_rule(const AdamRule& k, float v, float g, float p) {
  const float d = adam_grad(k, g, p);
  return rn_add(aff(v, k.beta2), aff(rn_mul(d, d), k.one_minus_beta2));
}

// amsgrad: candle's maximum (NaN in mx is kept).
TANDEM_HD float adam_running_max_rule(float mx, float v) { return mx < v ? v : mx; }

// p = decay(p) - step_size·exp_avg / (sqrt(second)·inv_bc2_sqrt + eps)
TANDEM_HD float adam_param_rule(const AdamRule& k, float p, float m, float s) {
  const float base = k.has_decay ? aff(p, k.decay) : p;
  const float denom = rn_add(rn_mul(sqrtf(s), k.inv_bc2_sqrt), k.eps);
  return rn_add(base, aff(rn_div(m, denom), k.neg_step_size));
}
