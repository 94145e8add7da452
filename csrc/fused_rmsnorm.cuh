// Fused all-reduce + residual add + RMSNorm for decode-sized inputs (tokens x hidden).
//
// It is the one-shot exchange laid out by rows: each block takes whole rows, pushes the row's packets to
// every peer, sums the packets that arrive in rank order, and finishes the row with the add and the norm
// while the row is still in registers. The all-reduced row never goes back to memory before the norm.
//
// Rounding follows the unfused path as vLLM serves it: the all-reduce result is stored as D (a = D(sum)),
// then vLLM's native (fused_add_)rms_norm, which torch.compile turns into one fp32 expression:
//   z = a + residual in fp32, residual_out = D(z), variance over the unrounded z,
//   out = D(z * inv_rms * weight)   (inductor drops the eager D() between the scale and the weight).
// The only difference left is the order in which the row's sum of squares is added (inv_rms may differ
// in its last fp32 bit), so outputs match bit for bit except, rarely, by one ulp.
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

// A row is cut into `splits` chunks, one block each, so a single decode token still spreads its pushes
// over several SMs (one SM alone cannot drive the link fast enough). The blocks of a row then agree on the
// row's sum of squares through `scratch`: each publishes its partial as a flag-in-data packet and every
// block adds the `splits` partials in the same order, so all blocks (and all ranks) get the same bits.
//
// Items (row, split) are grid-strided with gridDim.x a multiple of `splits`, so the blocks of one row are
// always in the same round and co-resident (grid <= SM count, one block per SM at most 1024 threads).
// The partial slot of a block alternates by round parity: a block can be at most one round ahead of a
// sibling still reading its previous partial, because it needs that sibling's next partial to move on.
//
// K: packets per thread (a template parameter so the row lives in registers, not local memory). The host
// picks the smallest K with K * blockDim >= packets per chunk.
template <class D, int K>
__device__ __forceinline__ void fc_fused_rmsnorm(const FcTable* __restrict__ t, const char* in, const char* residual,
                                                 const char* __restrict__ weight, char* out, char* residual_out,
                                                 u32 tokens, u32 hidden, u32 splits, float eps) {
  typedef FcPayload<D> P;
  __shared__ float smem32[32];
  __shared__ float total_ss;
  __shared__ float partial[32];  // splits <= 32 (fastcomm/abi.py FUSED_MAX_SPLITS)

  const u32 epoch = fc_begin(t);
  const u32 h = epoch & 1u;
  const u32 npush = t->n_ll_push;
  const u64 row_bytes = (u64)hidden * sizeof(typename D::raw);
  const u64 row_pk = (row_bytes + FC_PACKET_PAYLOAD - 1) / FC_PACKET_PAYLOAD;
  const u64 chunk_pk = (row_pk + splits - 1) / splits;
  const u32 items = tokens * splits;

  u32 round = 0;
  for (u32 item = blockIdx.x; item < items; item += gridDim.x, ++round) {
    const u32 row = item / splits;
    const u32 split = item % splits;
    const u64 base = (u64)row * row_bytes;
    const u64 pk0 = (u64)row * row_pk;
    const u64 c0 = (u64)split * chunk_pk;
    const u64 c1 = c0 + chunk_pk < row_pk ? c0 + chunk_pk : row_pk;

    // Push the chunk, and start the residual and weight loads now: they complete while we wait for peers.
    uint2 mine[K], res[K], w[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const u64 i = c0 + threadIdx.x + (u64)k * blockDim.x;
      if (i < c1) {
        mine[k] = fc_load_payload(in + base, i, row_bytes);
        for (u32 j = 0; j < npush; ++j)
          fc_store_packet(t->ll_push[h][j] + (pk0 + i) * FC_PACKET_BYTES, mine[k].x, epoch, mine[k].y, epoch);
        res[k] = residual ? fc_load_payload(residual + base, i, row_bytes) : make_uint2(0u, 0u);
        w[k] = fc_load_payload(weight, i, row_bytes);
      }
    }

    // Sum, round as the unfused all-reduce would store it (a), add the residual in fp32 (z, not rounded).
    // The row is kept as packed a (exact: a is a D value) beside the residual's packets, and z is formed
    // again below: a quarter of the registers that z in fp32 would take.
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const u64 i = c0 + threadIdx.x + (u64)k * blockDim.x;
      if (i < c1) {
        float acc[1][P::N], r[P::N];
        const u64 off[1] = {(pk0 + i) * FC_PACKET_BYTES};
        const bool valid[1] = {true};
        fc_gather_sum<D, 1>(t, h, off, valid, epoch, &mine[k], FC_STEP_FUSED, acc);
        P::unpack(res[k], r);
#pragma unroll
        for (int e = 0; e < P::N; ++e) {
          // Padding lanes of a row's last packet are zero-filled, so they add nothing to ss.
          const float a = (i * P::N + e < hidden) ? D::to_f(D::from_f(acc[0][e])) : 0.f;
          const float z = residual ? a + r[e] : a;  // no "+ 0" without a residual: it would turn -0 into +0
          acc[0][e] = a;
          ss += z * z;
        }
        mine[k] = P::pack(acc[0]);  // mine[k] now holds a
      }
    }
    ss = fc_block_sum(ss, smem32);

    if (splits == 1) {
      if (threadIdx.x == 0) total_ss = ss;
    } else {
      // Publish my partial, then read the row's partials (one thread each) and add them in split order.
      const u32 slot_parity = round & 1u;
      if (threadIdx.x == 0)
        fc_store_packet(t->scratch + ((u64)blockIdx.x * 2 + slot_parity) * FC_PACKET_BYTES, __float_as_uint(ss), epoch,
                        round, epoch);
      const u32 first = blockIdx.x - split;  // block holding split 0 of this row in this round
      if (threadIdx.x < splits) {
        const char* p = t->scratch + ((u64)(first + threadIdx.x) * 2 + slot_parity) * FC_PACKET_BYTES;
        u32 v, f0, rr, f1;
        fc_load_packet(p, v, f0, rr, f1);
        if (f0 != epoch || f1 != epoch || rr != round) {
          FcDeadline dl(t->timeout_ns);
          do {
            if (dl.expired()) fc_fail(t, t->rank, FC_STEP_FUSED, epoch);
            fc_load_packet(p, v, f0, rr, f1);
          } while (f0 != epoch || f1 != epoch || rr != round);
        }
        partial[threadIdx.x] = __uint_as_float(v);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        float s = 0.f;
        for (u32 q = 0; q < splits; ++q) s += partial[q];
        total_ss = s;
      }
    }
    __syncthreads();

    const float inv = rsqrtf(total_ss / (float)hidden + eps);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const u64 i = c0 + threadIdx.x + (u64)k * blockDim.x;
      if (i < c1) {
        float wf[P::N], z[P::N], r[P::N], o[P::N];
        P::unpack(w[k], wf);
        P::unpack(mine[k], z);
        P::unpack(res[k], r);
#pragma unroll
        for (int e = 0; e < P::N; ++e) {
          if (residual) z[e] += r[e];  // the same fp32 z as in the sum of squares above
          o[e] = z[e] * inv * wf[e];
        }
        if (residual_out) fc_store_payload(residual_out + base, i, row_bytes, P::pack(z));  // D(z)
        fc_store_payload(out + base, i, row_bytes, P::pack(o));
      }
    }
    __syncthreads();  // smem32 / total_ss are reused by the next item
  }
  fc_end(t, epoch);
}
