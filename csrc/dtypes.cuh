// fp32 upcast/downcast of the storage dtypes, shared by the communication kernels (common.cuh) and the GGUF
// K-quant kernels (kquant.cu). No CUDA headers (NVRTC and nvcc alike).
#pragma once

// ---- dtypes ---------------------------------------------------------------------------------------------
// Each type maps a raw storage word to fp32 and back (round to nearest even). Raw bits, no headers.

struct FcBF16 {
  typedef unsigned short raw;
  static __device__ __forceinline__ float to_f(raw b) { return __uint_as_float(((unsigned)b) << 16); }
  static __device__ __forceinline__ raw from_f(float f) {
    raw r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
  }
};

struct FcF16 {
  typedef unsigned short raw;
  static __device__ __forceinline__ float to_f(raw b) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
    return f;
  }
  static __device__ __forceinline__ raw from_f(float f) {
    raw r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
  }
};

struct FcF32 {
  typedef unsigned raw;
  static __device__ __forceinline__ float to_f(raw b) { return __uint_as_float(b); }
  static __device__ __forceinline__ raw from_f(float f) { return __float_as_uint(f); }
};

