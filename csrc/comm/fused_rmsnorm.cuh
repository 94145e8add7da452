// Fused all-reduce + residual add + RMSNorm for decode-sized inputs (tokens x hidden).
//
// The one-shot exchange (Lamport slots, common.cuh) with the norm finished where the data lands. The
// message keeps the one-shot's layout: vector j of every slot is bytes [16j, 16j + 16) of the flattened
// input, so the two kernels share buffers, rotation and clears. Rows need not be 16-byte aligned.
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

// The outputs of vectors [c0, c1) of the row holding elements [e0, e1) (lo: the row's first vector), once
// the row's inv_rms is known and every rank's data has arrived (so the gathers do not wait): a = D(sum in
// rank order), z = a + residual in fp32 (the same z as in the sum of squares), residual_out = D(z),
// out = D(z * inv * weight). Vectors inside the row are stored whole, the row's edges element by element.
// Shared by fc_fused_rmsnorm (step 3) and fc_fused_cluster (step 4).
template <class D>
__device__ __forceinline__ void fc_fused_write_chunk(const FcTable* __restrict__ t, const FcLpCall& c, u64 c0, u64 c1,
                                                     u64 lo, u64 e0, u64 e1, u64 total, u64 row_bytes,
                                                     const char* residual, const char* __restrict__ weight, char* out,
                                                     char* residual_out, float inv) {
  typedef FcVec<D> V;
  typedef typename D::raw R;
  for (u64 j = c0 + threadIdx.x; j < c1; j += blockDim.x) {
    float acc[V::N];
    fc_lp_gather_sum<D, true>(t, c.buf, j * FC_VEC_BYTES, make_uint4(0u, 0u, 0u, 0u), FC_STEP_FUSED, c.epoch, acc);
    uint4 rv = residual ? fc_load_vec(residual, j, total) : make_uint4(0u, 0u, 0u, 0u);
    const bool whole = j * V::N >= e0 && (j + 1) * V::N <= e1;  // vector inside the row (hence the message)
    // The weight as one vector when it lines up (weight itself need not be 16-byte aligned), else per element.
    const bool wvec = whole && (row_bytes & 15u) == 0 && (reinterpret_cast<u64>(weight) & 15u) == 0;
    uint4 wv = wvec ? *reinterpret_cast<const uint4*>(weight + (j - lo) * FC_VEC_BYTES) : make_uint4(0u, 0u, 0u, 0u);
    const R* rr = reinterpret_cast<const R*>(&rv);
    R* wr = reinterpret_cast<R*>(&wv);
    uint4 zv, ov;
    R* zr = reinterpret_cast<R*>(&zv);
    R* orr = reinterpret_cast<R*>(&ov);
#pragma unroll
    for (int e = 0; e < V::N; ++e) {
      const u64 g = j * V::N + e;
      if (!wvec && g >= e0 && g < e1) wr[e] = reinterpret_cast<const R*>(weight)[g - e0];
      const float a = D::to_f(D::from_f(acc[e]));
      const float z = residual ? a + D::to_f(rr[e]) : a;  // the same fp32 z as in the sum of squares
      zr[e] = D::from_f(z);                               // residual_out = D(z)
      orr[e] = D::from_f(z * inv * D::to_f(wr[e]));
    }
    if (whole) {
      if (residual_out) *reinterpret_cast<uint4*>(residual_out + j * FC_VEC_BYTES) = zv;
      *reinterpret_cast<uint4*>(out + j * FC_VEC_BYTES) = ov;
    } else {
#pragma unroll
      for (int e = 0; e < V::N; ++e) {
        const u64 g = j * V::N + e;
        if (g >= e0 && g < e1) {
          if (residual_out) reinterpret_cast<R*>(residual_out)[g] = zr[e];
          reinterpret_cast<R*>(out)[g] = orr[e];
        }
      }
    }
  }
}

// A row is cut into `splits` chunks, one block each, so a single decode token still spreads its pushes
// over several SMs. No block waits for another's partial sum: every block of a row reads the WHOLE row's
// arrived data (all ranks' terms, its own rank's from its own slot) and computes the row's sum of squares
// itself, thread t taking vectors lo + t, lo + t + blockDim, ... in one fixed order. That order depends on
// the row and blockDim only, so every block of the row and every rank gets the same bits. Each block then
// writes only its chunk of the outputs.
//
// Who reads what, so that outputs may alias inputs (out is x, residual_out is residual):
//  - vector j of x is read only by the block that pushes it (the owner: the row holding byte 16j), and
//    every output byte is written only after its writer has seen, in its own slot, the vectors covering
//    its row, each stored from the x bytes just read (a data dependency). So x is read before it is
//    overwritten, whichever block does either.
//  - residual is read over the whole row by every block of the row; a sibling writing residual_out over
//    it would race, so when an output overlaps the residual the host sets splits = 1 (fused_launch).
//  - the slots of this call are never cleared in this call (the clears are one call later, common.cuh).
//
// Items (row, split) are grid-strided with gridDim.x a multiple of `splits`, so the blocks of one row are
// always in the same round and co-resident (grid <= SM count, one block per SM at most 1024 threads). A
// row also reads its first vector when that one starts in the previous row; the previous row is in the
// same round or an earlier one, and its blocks push before they wait, so the waits cannot close a cycle.
//
// K: the row pass covers K x blockDim vectors (a template parameter, so the trip count is a constant).
//
// Islands (ISL, ti = the island's table, t = the partners'): before the push, each block sums its owned
// vectors inside the island (one-shot style, own term from registers) and rounds that island sum to D,
// then pushes it to the partners in place of its input; the rows are then read from the partners' slots.
// Rounding rule: the island sum is rounded to D before it crosses, the same bits as the island one-shot
// followed by the partners' fused kernel that this replaces; every rank still agrees bit for bit (all
// members of an island compute the same island sum, everyone adds the same partials in island order).
// x is still read only by the owner block, and everything pushed depends on those reads.
template <class D, int K, bool ISL>
__device__ __forceinline__ void fc_fused_rmsnorm(const FcTable* __restrict__ ti, const FcTable* __restrict__ t,
                                                 const char* in, const char* residual,
                                                 const char* __restrict__ weight, char* out, char* residual_out,
                                                 u32 tokens, u32 hidden, u32 splits, float eps) {
  typedef FcVec<D> V;
  typedef typename D::raw R;
  __shared__ float smem32[32];

  const FcLpCall c = fc_lp_begin(t);
  FcLpCall ci = c;
  if (ISL) ci = fc_lp_begin(ti);
  const u32 npush = t->n_lp_push;
  const u64 row_bytes = (u64)hidden * sizeof(R);
  const u64 total = (u64)tokens * row_bytes;
  const u64 nvec = (total + FC_VEC_BYTES - 1) / FC_VEC_BYTES;
  const u32 items = tokens * splits;

  fc_lp_clear_received(t, c);
  if (ISL) fc_lp_clear_received(ti, ci);

  bool gathered = false, gathered_i = false;
  for (u32 item = blockIdx.x; item < items; item += gridDim.x) {
    const u32 row = item / splits;
    const u32 split = item % splits;
    const u64 e0 = (u64)row * hidden, e1 = e0 + hidden;          // the row's elements
    const u64 lo = (u64)row * row_bytes / FC_VEC_BYTES;          // first vector holding a byte of the row
    const u64 hi = ((u64)(row + 1) * row_bytes + FC_VEC_BYTES - 1) / FC_VEC_BYTES;
    const u64 own_lo = ((u64)row * row_bytes + FC_VEC_BYTES - 1) / FC_VEC_BYTES;  // vectors starting in it
    const u64 chunk = (hi - lo + splits - 1) / splits;
    const u64 c0 = lo + (u64)split * chunk;
    const u64 c1 = c0 + chunk < hi ? c0 + chunk : hi;

    // 1. Push the vectors of my chunk that this row owns, to every peer and (P2P) to my own slot, which
    //    my sibling blocks read. Host: lp_push[b][0] is my own slot, read by peers and siblings alike.
    for (u64 j = (c0 > own_lo ? c0 : own_lo) + threadIdx.x; j < c1; j += blockDim.x) {
      uint4 mine = fc_lp_sanitize<D>(fc_load_vec(in, j, total));
      if (ISL) {
        for (u32 p = 0; p < ti->n_lp_push; ++p) fc_lp_store(ti->lp_push[ci.buf][p] + j * FC_VEC_BYTES, mine);
        float part[V::N];
        fc_lp_gather_sum<D>(ti, ci.buf, j * FC_VEC_BYTES, mine, FC_STEP_FUSED, ci.epoch, part);
        mine = fc_lp_sanitize<D>(V::pack(part));  // the island sum as D (the rule above)
        gathered_i = true;
      }
      fc_lp_push(t, npush, c.buf, j * FC_VEC_BYTES, mine);
    }

    // 2. The whole row: a = D(sum over ranks in rank order), z = a + residual in fp32 (not rounded),
    //    sum of squares in a fixed order. Residual vectors are read whole; lanes outside the row are unused.
    float ss = 0.f;
#pragma unroll 1
    for (int k = 0; k < K; ++k) {
      const u64 j = lo + threadIdx.x + (u64)k * blockDim.x;
      if (j < hi) {
        float acc[V::N];
        fc_lp_gather_sum<D, true>(t, c.buf, j * FC_VEC_BYTES, make_uint4(0u, 0u, 0u, 0u), FC_STEP_FUSED, c.epoch,
                                  acc);
        gathered = true;
        uint4 rv = residual ? fc_load_vec(residual, j, total) : make_uint4(0u, 0u, 0u, 0u);
        const R* rr = reinterpret_cast<const R*>(&rv);
#pragma unroll
        for (int e = 0; e < V::N; ++e) {
          const u64 g = j * V::N + e;
          if (g >= e0 && g < e1) {
            const float a = D::to_f(D::from_f(acc[e]));
            const float z = residual ? a + D::to_f(rr[e]) : a;  // no "+ 0" without a residual: -0 stays -0
            ss += z * z;
          }
        }
      }
    }
    ss = fc_block_sum(ss, smem32);
    const float inv = rsqrtf(ss / (float)hidden + eps);

    // 3. My chunk of the outputs. The data has arrived (step 2 saw all of it), so these loads do not wait.
    fc_fused_write_chunk<D>(t, c, c0, c1, lo, e0, e1, total, row_bytes, residual, weight, out, residual_out, inv);
    __syncthreads();  // smem32 is reused by the next item
  }

  fc_lp_clear_own_after_gather<D>(t, c, gathered, FC_STEP_FUSED);
  if (ISL) {
    fc_lp_clear_own_after_gather<D>(ti, ci, gathered_i, FC_STEP_FUSED);
    fc_lp_end(ti, ci, (u32)(nvec * FC_VEC_BYTES));
  }
  fc_lp_end(t, c, (u32)(nvec * FC_VEC_BYTES));
}
