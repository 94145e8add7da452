// Fused all-reduce + residual add + RMSNorm for decode-sized inputs (tokens x hidden).
//
// It is the one-shot exchange laid out by rows: each block takes whole rows, pushes the row's packets to
// every peer, sums the packets that arrive in rank order, and finishes the row with the add and the norm
// while the row is still in registers. The all-reduced row never goes back to memory before the norm.
//
// Rounding follows the unfused path exactly (all-reduce result stored as D, vLLM's fused_add_rms_norm:
// z = D(ar + residual); variance over z in fp32; out = D(D(z * inv_rms) * weight)), so the fused op can
// replace all_reduce + fused_add_rms_norm without changing a single output bit.
#pragma once
#include "common.cuh"

__device__ __forceinline__ float fc_block_sum(float v, float* smem32) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // smem32 may still be read by the previous row
  if (lane == 0) smem32[warp] = v;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) >> 5;
  float s = 0.f;
  for (int w = 0; w < nwarps; ++w) s += smem32[w];  // same order in every thread and on every rank
  return s;
}

template <class D>
__device__ __forceinline__ void fc_fused_rmsnorm(const FcTable* __restrict__ t, const char* in, const char* residual,
                                                 const char* __restrict__ weight, char* out, char* residual_out,
                                                 u32 tokens, u32 hidden, float eps) {
  typedef FcPayload<D> P;
  typedef typename D::raw R;
  constexpr int K = FC_ROW_PACKETS_PER_THREAD;
  __shared__ float smem32[32];

  const u32 epoch = fc_begin(t);
  const u32 h = epoch & 1u;
  const u32 world = t->world;
  const u32 me = t->rank;
  const u32 npush = t->n_ll_push;
  const u64 row_bytes = (u64)hidden * sizeof(R);
  const u64 row_pk = (row_bytes + FC_PACKET_PAYLOAD - 1) / FC_PACKET_PAYLOAD;

  for (u32 row = blockIdx.x; row < tokens; row += gridDim.x) {
    const u64 base = (u64)row * row_bytes;
    const u64 pk0 = (u64)row * row_pk;

#pragma unroll
    for (int k = 0; k < K; ++k) {
      const u64 i = threadIdx.x + (u64)k * blockDim.x;
      if (i < row_pk) {
        const uint2 d = fc_load_payload(in + base, i, row_bytes);
        for (u32 j = 0; j < npush; ++j)
          fc_store_packet(t->ll_push[h][j] + (pk0 + i) * FC_PACKET_BYTES, d.x, epoch, d.y, epoch);
      }
    }

    // The row stays in registers as D-rounded packed values (z is exactly representable in D), which
    // halves the register footprint of 16-bit rows and keeps 1024-thread blocks free of spills.
    uint2 zp[K];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const u64 i = threadIdx.x + (u64)k * blockDim.x;
      if (i < row_pk) {
        float acc[P::N], v[P::N], r[P::N];
        for (u32 src = 0; src < world; ++src) {
          // My own packet is re-read from the input (cache-hot) rather than kept live across the pushes.
          const uint2 d = (src == me) ? fc_load_payload(in + base, i, row_bytes)
                                      : fc_wait_packet(t, t->ll_pull[h][src] + (pk0 + i) * FC_PACKET_BYTES, epoch, src, FC_STEP_FUSED);
          P::unpack(d, v);
#pragma unroll
          for (int e = 0; e < P::N; ++e) acc[e] = (src == 0) ? v[e] : acc[e] + v[e];
        }
        if (residual) P::unpack(fc_load_payload(residual + base, i, row_bytes), r);
#pragma unroll
        for (int e = 0; e < P::N; ++e) {
          float a = D::to_f(D::from_f(acc[e]));
          if (residual) a = D::to_f(D::from_f(a + r[e]));
          // Padding lanes of a row's last packet are zero-filled, so they add nothing to ss.
          acc[e] = (i * P::N + e < hidden) ? a : 0.f;
          ss += acc[e] * acc[e];
        }
        zp[k] = P::pack(acc);
      }
    }

    const float inv = rsqrtf(fc_block_sum(ss, smem32) / (float)hidden + eps);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const u64 i = threadIdx.x + (u64)k * blockDim.x;
      if (i < row_pk) {
        float w[P::N], z[P::N], o[P::N];
        P::unpack(fc_load_payload(weight, i, row_bytes), w);
        P::unpack(zp[k], z);
#pragma unroll
        for (int e = 0; e < P::N; ++e) o[e] = D::to_f(D::from_f(z[e] * inv)) * w[e];
        if (residual_out) fc_store_payload(residual_out + base, i, row_bytes, zp[k]);
        fc_store_payload(out + base, i, row_bytes, P::pack(o));
      }
    }
  }
  fc_end(t, epoch);
}
