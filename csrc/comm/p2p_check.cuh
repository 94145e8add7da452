// Build-time P2P check: write a known pattern into a peer's buffer through the path the collectives use
// (16-byte SM stores over P2P), so a pair that reports P2P but drops writes (ACS or an IOMMU in the way)
// is caught at workspace build, before any collective spins on data that never comes. The receiving rank
// reads the pattern back from its own memory (a host copy, no wait), and the ranks agree on the verdict.
#pragma once
#include "common.cuh"

__device__ __forceinline__ void fc_p2p_check_body(char* dst, u64 pattern, u32 count) {
  for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
    const u64 v = pattern ^ ((u64)i * 0x9E3779B97F4A7C15ull);
    asm volatile("st.volatile.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst + (u64)i * 16), "r"((u32)v),
                 "r"((u32)(v >> 32)), "r"(~(u32)v), "r"(~(u32)(v >> 32)));
  }
  __threadfence_system();  // the stores are performed before the launch completes; the host syncs on that
}
