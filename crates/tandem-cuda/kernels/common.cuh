// Shared by tandem's CUDA kernels: element types, conversions, deterministic block sums.
//
// Every kernel comes in three element types — f32, f16 (__half), bf16 (__nv_bfloat16) — named
// NAME_f32, NAME_f16, NAME_bf16; arithmetic is f32 (sums f64), as torch.autocast keeps it.
// Reductions never use atomics: each block sums in a fixed tree, and partial sums are added
// in index order by a second kernel, so results are the same bits run after run. Products
// are written with the _rn intrinsics where the CPU twin rounds each step (nvcc would
// otherwise contract a*b+c into one fma and differ from the CPU in the last bit).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stddef.h>
#include <stdint.h>

#define TANDEM_BLOCK 256

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Sums `a` and `b` over the block (blockDim.x == TANDEM_BLOCK) in a fixed tree; thread 0's
// return values are the totals.
__device__ __forceinline__ void block_sum2(double& a, double& b) {
  __shared__ double sa[TANDEM_BLOCK];
  __shared__ double sb[TANDEM_BLOCK];
  const unsigned t = threadIdx.x;
  sa[t] = a;
  sb[t] = b;
  __syncthreads();
  for (unsigned s = TANDEM_BLOCK / 2; s > 0; s >>= 1) {
    if (t < s) {
      sa[t] += sa[t + s];
      sb[t] += sb[t + s];
    }
    __syncthreads();
  }
  a = sa[0];
  b = sb[0];
  __syncthreads();
}

__device__ __forceinline__ double block_sum(double a) {
  double b = 0.0;
  block_sum2(a, b);
  return a;
}

// Grid-stride loop over [0, n).
#define GRID_STRIDE(i, n)                                                              \
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);              \
       i += (size_t)gridDim.x * blockDim.x)

// Instantiates `NAME_f32/_f16/_bf16` from a template `NAME_impl<T>` with the given
// parameter list (types with T) and argument names.
#define FOR_EACH_TYPE(MACRO) \
  MACRO(f32, float)          \
  MACRO(f16, __half)         \
  MACRO(bf16, __nv_bfloat16)
