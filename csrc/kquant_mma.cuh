// Tensor-core forms of the K-quant decode products (int8 mma.sync, sm_80+): a 16-row tile of a weight
// against up to 8 activation vectors, the dense product and the MoE grouped by expert.
//
// Why: the dp4a forms (kquant.cu) make 8 dp4a and read 40 bytes of activations per chunk, row and vector,
// so their cost grows with the vectors: on an H200 a GLM-5 o_proj took 27.6 us at 1 token and 89 at 8. Here
// one mma per chunk serves 16 rows and 8 vectors, and each vector's operands are loaded once per 16 rows, so
// the cost per weight byte barely moves from 1 to 8 vectors (an MTP verify step, 8 requests). The grouped MoE
// reads each routed expert once for all the tokens routed to it (the dp4a MoE reads it once per (token,
// expert) pair).
//
// Work: a block of W warps (blockDim.x = 32 W, W <= FC_KQ_MMA_WARPS) owns one 16-row tile; warp w takes the
// 256-value units w, w + W, ... of the rows, and warp 0 adds the warps' partial sums in warp order, so every
// output is summed in one fixed order whatever the vectors are. The host picks W per shape
// (kquant.mma_warps): a weight of few tiles spreads each tile's units over more warps, so that the GPU still
// has enough warps streaming weights (GLM-5's fused_qkv_a: 164 tiles). Operands: kq_unit_load / kq_unit_chunk /
// kq_frag_x (kquant.cuh), activations quantized first (fc_kq_quantize), as the dp4a two-launch form does.
#pragma once
#include "kquant.cuh"

#define FC_KQ_MMA_ROWS 16    // rows of a tile: the mma's M
#define FC_KQ_MMA_COLS 8     // activation vectors per pass: the mma's N
#define FC_KQ_MMA_WARPS 16   // the most warps splitting a tile's units (few tiles: more warps a tile)
#define FC_KQ_MAX_PAIRS 256  // (token, expert) pairs a grouped MoE launch routes

__device__ __forceinline__ void kq_mma_k32(const kq_u32 a[4], const kq_u32 b[2], int c[4]) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};"
      : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0), "r"(0), "r"(0), "r"(0));
}

// The activation rows a thread reads: vector g's operands, and the scales of the vectors 2t and 2t + 1 whose
// outputs it holds (the mma's C layout: rows g and g + 8, columns 2t and 2t + 1). A column past the call's
// vectors reads a real one (its outputs are written nowhere, and an mma's columns do not mix).
struct KqCols {
  int op, d0, d1;
};

// One warp's share of a tile: rows g (at ra) and g + 8 (at rb), against the vectors of `col`. acc: row g
// with vectors 2t and 2t + 1, then row g + 8 with the same.
// Per unit, every load is issued before any use and none sits behind a branch, so the activations' L2 round
// trips overlap the weights' DRAM ones.
template <int T>
__device__ __forceinline__ void kq_mma_tile(const kq_u8* ra, const kq_u8* rb, int units, int cols,
                                            const KqCols& col, const kq_u32* xq, const float* xs, float acc[4]) {
  constexpr bool mins = T == FC_KQ_Q4_K || T == FC_KQ_Q5_K;
  const int t = threadIdx.x & 3, W = blockDim.x >> 5;
  const kq_u32 first = t < 2 ? 0xFFFFFFFFu : 0u;  // Q6_K: this thread's values are in the chunk's first half
  for (int u = threadIdx.x >> 5; u < units; u += W) {
    KqUnit ua, ub;
    KqXUnit x;
    kq_unit_load(T, ra, u, t, &ua);
    kq_unit_load(T, rb, u, t, &ub);
    kq_xunit_load<mins>(xq, xs, cols, u, col.op, col.d0, col.d1, t, &x);
    float uacc[4] = {0.f, 0.f, 0.f, 0.f}, umin[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      KqFrag fa, fb;
      kq_unit_chunk(T, ua, m, &fa);
      kq_unit_chunk(T, ub, m, &fb);
      const kq_u32 a[4] = {fa.q[0], fb.q[0], fa.q[1], fb.q[1]};
      int r[4], r2[4] = {0, 0, 0, 0};
      if (T == FC_KQ_Q6_K) {
        const kq_u32 lo[2] = {x.b[2 * m] & first, x.b[2 * m + 1] & first};
        const kq_u32 hi[2] = {x.b[2 * m] & ~first, x.b[2 * m + 1] & ~first};
        kq_mma_k32(a, lo, r);
        kq_mma_k32(a, hi, r2);
      } else {
        const kq_u32 b[2] = {x.b[2 * m], x.b[2 * m + 1]};
        kq_mma_k32(a, b, r);
      }
      kq_mma_chunk(T, fa, fb, r, r2, x, m, uacc, umin);
    }
    kq_mma_unit_end(T, ua, ub, uacc, umin, acc);
  }
}

__device__ __forceinline__ void kq_mma_tile_any(int type, const kq_u8* ra, const kq_u8* rb, int cols,
                                                const KqCols& col, const kq_u32* xq, const float* xs,
                                                float acc[4]) {
  const int units = cols / FC_KQ_UNIT;
  switch (type) {  // block-uniform: a tile lies in one segment
    case FC_KQ_Q4_K: kq_mma_tile<FC_KQ_Q4_K>(ra, rb, units, cols, col, xq, xs, acc); break;
    case FC_KQ_Q5_K: kq_mma_tile<FC_KQ_Q5_K>(ra, rb, units, cols, col, xq, xs, acc); break;
    case FC_KQ_Q6_K: kq_mma_tile<FC_KQ_Q6_K>(ra, rb, units, cols, col, xq, xs, acc); break;
    default: kq_mma_tile<FC_KQ_Q8_0>(ra, rb, units, cols, col, xq, xs, acc); break;
  }
}

// Warp 0's acc += the other warps' partials, in warp order; true on warp 0 (which then holds the tile's sums).
// Every thread of the block calls it (it synchronizes the block when there is more than one warp).
__device__ __forceinline__ bool kq_mma_reduce(float acc[4], float (*part)[4][32]) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
  if (W == 1) return true;
  if (w > 0) {
#pragma unroll
    for (int j = 0; j < 4; ++j) part[w - 1][j][lane] = acc[j];
  }
  __syncthreads();
  if (w > 0) return false;
  for (int v = 0; v < W - 1; ++v) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[j] += part[v][j][lane];
  }
  return true;
}

// Dense: rows [16 blockIdx.x, +16) of the segments against vectors 0 .. n - 1 (n <= 8); out as kq_gemv's.
template <typename D>
__device__ void kq_mma_gemv(const KqSegs& segs, const kq_u32* xq, const float* xs, int n, int cols,
                            typename D::raw* out, kq_u64 out_stride) {
  __shared__ float part[FC_KQ_MMA_WARPS - 1][4][32];
  const int r0 = blockIdx.x * FC_KQ_MMA_ROWS, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const KqSeg sg = kq_segment(segs, r0);  // the host keeps segment starts on tile boundaries
  const int last = segs.total_rows - 1;    // a last partial tile reads its last row again, writes nothing
  const kq_u8* ra = sg.w + (kq_u64)(min(r0 + g, last) - sg.row0) * sg.row_stride;
  const kq_u8* rb = sg.w + (kq_u64)(min(r0 + g + 8, last) - sg.row0) * sg.row_stride;
  const KqCols col = {min(g, n - 1), min(2 * t, n - 1), min(2 * t + 1, n - 1)};
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  kq_mma_tile_any(sg.type, ra, rb, cols, col, xq, xs, acc);
  if (!kq_mma_reduce(acc, part)) return;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = r0 + g + 8 * (j >> 1), v = 2 * t + (j & 1);
    if (r <= last && v < n) out[v * out_stride + sg.out_col + (r - sg.row0)] = D::from_f(acc[j]);
  }
}

// The pairs p = token * topk + k (p < pairs) whose expert topk_ids[p] is e, in pair order, into s_pair;
// returns their count. Every thread of the block calls it.
__device__ __forceinline__ int kq_route(const int* topk_ids, int pairs, int e, int* s_pair, unsigned* s_mask) {
  const int lane = threadIdx.x & 31, W = blockDim.x >> 5;
  for (int base = (threadIdx.x >> 5) * 32; base < pairs; base += W * 32) {  // warp-uniform
    const int i = base + lane;
    const unsigned m = __ballot_sync(0xffffffffu, i < pairs && __ldg(topk_ids + i) == e);
    if (lane == 0) s_mask[base >> 5] = m;
  }
  __syncthreads();
  const int words = (pairs + 31) >> 5;
  int count = 0;
  for (int k = 0; k < words; ++k) count += __popc(s_mask[k]);
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    const unsigned m = s_mask[i >> 5];
    if ((m >> (i & 31)) & 1u) {
      int pos = __popc(m & ((1u << (i & 31)) - 1u));
      for (int k = 0; k < (i >> 5); ++k) pos += __popc(s_mask[k]);
      s_pair[pos] = i;
    }
  }
  __syncthreads();
  return count;
}

// Grouped MoE: block (tile, expert blockIdx.y) reads the tile of its expert's weight (rows of w + e *
// expert_stride) once per 8 pairs routed to it. UP: vector = the pair's token (xq: one row per token), out
// [pairs][rows] in the dtype; else vector = the pair itself (xq: one row per pair), out [pairs][rows] in fp32
// (kq_moe_sum weights and adds them). A pair whose expert is no block's (outside [0, gridDim.y)) is written
// by none and read by none.
template <typename D, bool UP>
__device__ void kq_mma_moe(const kq_u8* w, kq_u64 expert_stride, kq_u64 row_stride, int type, int rows, int cols,
                           const int* topk_ids, int topk, int pairs, const kq_u32* xq, const float* xs,
                           void* out) {
  __shared__ float part[FC_KQ_MMA_WARPS - 1][4][32];
  __shared__ int s_pair[FC_KQ_MAX_PAIRS];
  __shared__ unsigned s_mask[FC_KQ_MAX_PAIRS / 32];
  const int count = kq_route(topk_ids, pairs, blockIdx.y, s_pair, s_mask);
  const int r0 = blockIdx.x * FC_KQ_MMA_ROWS, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const kq_u8* ew = w + (kq_u64)blockIdx.y * expert_stride;
  const kq_u8* ra = ew + (kq_u64)min(r0 + g, rows - 1) * row_stride;
  const kq_u8* rb = ew + (kq_u64)min(r0 + g + 8, rows - 1) * row_stride;
  for (int base = 0; base < count; base += FC_KQ_MMA_COLS) {  // block-uniform; one pass unless > 8 pairs
    const int n = min(count - base, FC_KQ_MMA_COLS);
    auto vec = [&](int j) {
      const int p = s_pair[base + min(j, n - 1)];
      return UP ? p / topk : p;
    };
    const KqCols col = {vec(g), vec(2 * t), vec(2 * t + 1)};
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    kq_mma_tile_any(type, ra, rb, cols, col, xq, xs, acc);
    if (kq_mma_reduce(acc, part)) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = r0 + g + 8 * (j >> 1), v = 2 * t + (j & 1);
        if (r < rows && v < n) {
          const kq_u64 at = (kq_u64)s_pair[base + v] * rows + r;
          if (UP) {
            static_cast<typename D::raw*>(out)[at] = D::from_f(acc[j]);
          } else {
            static_cast<float*>(out)[at] = acc[j];
          }
        }
      }
    }
    if (base + FC_KQ_MMA_COLS < count) __syncthreads();  // warp 0 has read `part` before the next pass writes it
  }
}

// out[t, r] = sum over k of topk_weights[t, k] * y[t * topk + k, r], in k order; a pair routed outside
// [0, experts) adds nothing.
template <typename D>
__device__ void kq_moe_sum(const float* y, const int* topk_ids, const float* topk_weights, int topk, int experts,
                           int tokens, int rows, typename D::raw* out) {
  const kq_u64 i = (kq_u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (kq_u64)tokens * rows) return;
  const int t = (int)(i / rows), r = (int)(i - (kq_u64)t * rows);
  float s = 0.f;
  for (int k = 0; k < topk; ++k) {
    const int p = t * topk + k, e = __ldg(topk_ids + p);
    if (e >= 0 && e < experts) s += __ldg(topk_weights + p) * y[(kq_u64)p * rows + r];
  }
  out[i] = D::from_f(s);
}
