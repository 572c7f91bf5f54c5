// The host check of the optimizer kernels' element rules (kernels/optim_rules.cuh), compiled
// by a plain C++ compiler with -ffp-contract=off and driven by tandem-optim's tests, which
// compare its answers with the CPU optimizers bit for bit. It applies the rules in the order
// the CUDA steps launch their kernels.
//
// Requests on stdin, answers on stdout, floats as the hex of their bits:
//   sgd NEG_LR WD MOMENTUM KEEP HAS_WD HAS_KEEP NESTEROV USE_BUF FIRST N, then N lines `P G B`
//     -> N lines `P B` (the buffer after the momentum kernel, the parameter after its own);
//   adam COUPLED_WD DECAY OMB1 BETA2 OMB2 INV_BC2_SQRT EPS NEG_STEP HAS_CWD HAS_DECAY AMSGRAD N,
//     then N lines `P G M V MX` -> N lines `P M V MX`.
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "optim_rules.cuh"

static float f(uint32_t bits) {
  float x;
  memcpy(&x, &bits, 4);
  return x;
}

static uint32_t u(float x) {
  uint32_t bits;
  memcpy(&bits, &x, 4);
  return bits;
}

static int sgd() {
  uint32_t h[4];
  SgdRule k;
  int first;
  size_t n;
  if (scanf("%x %x %x %x %d %d %d %d %d %zu", &h[0], &h[1], &h[2], &h[3], &k.has_wd,
            &k.has_keep, &k.nesterov, &k.use_buf, &first, &n) != 10)
    return 1;
  k.neg_lr = f(h[0]), k.wd = f(h[1]), k.momentum = f(h[2]), k.keep = f(h[3]);
  for (size_t i = 0; i < n; i++) {
    uint32_t p, g, b;
    if (scanf("%x %x %x", &p, &g, &b) != 3) return 1;
    float bn = f(b);
    if (k.use_buf) bn = sgd_momentum_rule(k, first, f(b), f(g), f(p));
    const float pn = sgd_param_rule(k, f(p), f(g), k.use_buf ? bn : 0.0f);
    printf("%08x %08x\n", u(pn), u(bn));
  }
  return 0;
}

static int adam() {
  uint32_t h[8];
  AdamRule k;
  int amsgrad;
  size_t n;
  if (scanf("%x %x %x %x %x %x %x %x %d %d %d %zu", &h[0], &h[1], &h[2], &h[3], &h[4], &h[5],
            &h[6], &h[7], &k.has_coupled_wd, &k.has_decay, &amsgrad, &n) != 12)
    return 1;
  k.coupled_wd = f(h[0]), k.decay = f(h[1]), k.one_minus_beta1 = f(h[2]), k.beta2 = f(h[3]);
  k.one_minus_beta2 = f(h[4]), k.inv_bc2_sqrt = f(h[5]), k.eps = f(h[6]);
  k.neg_step_size = f(h[7]);
  for (size_t i = 0; i < n; i++) {
    uint32_t p, g, m, v, mx;
    if (scanf("%x %x %x %x %x", &p, &g, &m, &v, &mx) != 5) return 1;
    const float mn = adam_first_moment_rule(k, f(m), f(g), f(p));
    const float vn = adam_second_moment_rule(k, f(v), f(g), f(p));
    const float mxn = amsgrad ? adam_running_max_rule(f(mx), vn) : f(mx);
    const float pn = adam_param_rule(k, f(p), mn, amsgrad ? mxn : vn);
    printf("%08x %08x %08x %08x\n", u(pn), u(mn), u(vn), u(mxn));
  }
  return 0;
}

int main() {
  char what[8];
  while (scanf("%7s", what) == 1) {
    int bad = strcmp(what, "sgd") == 0 ? sgd() : strcmp(what, "adam") == 0 ? adam() : 2;
    if (bad) {
      fprintf(stderr, "optim_rules: malformed request (%s)\n", what);
      return bad;
    }
  }
  return 0;
}
