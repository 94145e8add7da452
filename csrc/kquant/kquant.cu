// The launch file of the K-quant decode kernels (kquant.cuh, kquant_mma.cuh): extern "C" entry points by
// plain names,
//   fc_kq_quantize_<dt>           activations (n rows of `cols`) to int8 chunks + (scale, sum)
//   fc_kq_quantize_silu_<dt>      the same of silu(gate) * up, rows [gate | up] of 2 cols (vLLM's silu_and_mul)
//   fc_kq_gemv<N>_<dt>            up to N vectors against up to FC_KQ_MAX_SEGS row segments of a weight (dp4a)
//   fc_kq_gemvs<N>_<dt>           the same in one launch: the activations quantized into shared memory first
//   fc_kq_mma_<dt>                the same on the tensor cores: 16-row tiles, up to 8 vectors
//   fc_kq_moe_up_<dt>             one row of an expert per (token, expert) pair (dp4a)
//   fc_kq_moe_down_<dt>           per token: the router-weighted sum over its experts (dp4a)
//   fc_kq_moe_{up,down}_s_<dt>    the same two, each staging its activations (down: silu(gate) * up) itself
//   fc_kq_moe_mma_up_<dt>         grouped by expert on the tensor cores: each expert's rows once for its pairs
//   fc_kq_moe_mma_down            the same for the down rows, one fp32 row per pair
//   fc_kq_moe_mma_{up,down}_shared<type>  the same with a block's warps sharing each unit's activations
//   fc_kq_moe_sum_<dt>            per token: the router-weighted sum of its pairs' fp32 rows
//   fc_kq_dequant_<dt>            the segments' rows dequantized, for a prefill's GEMM on the tensor cores
// <dt> is the activations' and the output's dtype. Host side: fastcomm/kquant/; the C ABI's one
// mirror: fastcomm/kquant/abi.py.
#include "dtypes.cuh"
#include "kquant.cuh"
#include "kquant_mma.cuh"

__device__ __forceinline__ float kq_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);  // the same tree in every warp
  return v;
}

__device__ __forceinline__ void kq_load_x(const kq_u32* xq, const float2* xds, int chunks, int v, int c,
                                          kq_u32 q[8], float2* ds) {
  const kq_u8* p = reinterpret_cast<const kq_u8*>(xq + (kq_u64)v * chunks * 8 + 8 * c);
  kq_load16(p, q);
  kq_load16(p + 16, q + 4);
  *ds = xds[(kq_u64)v * chunks + c];
}

// One warp, one row of type T, against up to N vectors (n of them real): lane l takes chunks l, l + 32, ...
template <int T, int N>
__device__ __forceinline__ void kq_row(const kq_u8* row, const kq_u32* xq, const float2* xds, int chunks, int n,
                                       float acc[N]) {
  const int lane = threadIdx.x & 31;
#pragma unroll 2
  for (int c = lane; c < chunks; c += 32) {
    KqChunk k;
    kq_decode_chunk(T, row, c, &k);
#pragma unroll
    for (int v = 0; v < N; ++v) {
      if (v < n) {
        kq_u32 q[8];
        float2 ds;
        kq_load_x(xq, xds, chunks, v, c, q, &ds);
        acc[v] += kq_chunk_dot(k, q, ds.x, ds.y);
      }
    }
  }
}

template <int N>
__device__ __forceinline__ void kq_row_any(int type, const kq_u8* row, const kq_u32* xq, const float2* xds,
                                           int chunks, int n, float acc[N]) {
  switch (type) {  // warp-uniform
    case FC_KQ_Q4_K: kq_row<FC_KQ_Q4_K, N>(row, xq, xds, chunks, n, acc); break;
    case FC_KQ_Q5_K: kq_row<FC_KQ_Q5_K, N>(row, xq, xds, chunks, n, acc); break;
    case FC_KQ_Q6_K: kq_row<FC_KQ_Q6_K, N>(row, xq, xds, chunks, n, acc); break;
    default: kq_row<FC_KQ_Q8_0, N>(row, xq, xds, chunks, n, acc); break;
  }
}

// SILU: the rows are [gate | up] of 2 cols values and the vector is silu(gate) * up, each rounded to the dtype
// as vLLM's silu_and_mul hands it over (silu, then the product). mma: in the tensor-core forms' order
// (kq_mma_x_put; cols a multiple of 256), else chunk by chunk with (scale, sum) pairs (the dp4a forms').
template <typename D, bool SILU>
__device__ void kq_quantize(const typename D::raw* x, int n, int cols, kq_u64 x_stride, kq_u32* xq, float2* xds,
                            int mma) {
  kq_grid_enter();
  const int chunks = cols / FC_KQ_CHUNK;
  const kq_u64 i = (kq_u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (kq_u64)n * chunks) return;
  const int v = (int)(i / chunks), c = (int)(i % chunks);
  const typename D::raw* src = x + v * x_stride + (kq_u64)c * FC_KQ_CHUNK;
  float f[FC_KQ_CHUNK];
  for (int l = 0; l < FC_KQ_CHUNK; ++l) {
    if (SILU) {
      const float gate = D::to_f(src[l]), silu = D::to_f(D::from_f(gate / (1.f + expf(-gate))));
      f[l] = D::to_f(D::from_f(silu * D::to_f(src[l + cols])));
    } else {
      f[l] = D::to_f(src[l]);
    }
  }
  kq_u32 q[8];
  float d, s;
  kq_quantize_chunk(f, q, &d, &s);
  if (mma) {
    kq_mma_x_put(c, q, d, s, xq + (kq_u64)v * (cols / 4), reinterpret_cast<float*>(xds) + (kq_u64)v * (cols / 16));
    return;
  }
  uint4* dst = reinterpret_cast<uint4*>(xq + i * 8);
  dst[0] = make_uint4(q[0], q[1], q[2], q[3]);
  dst[1] = make_uint4(q[4], q[5], q[6], q[7]);
  xds[i] = make_float2(d, s);
}

template <typename D, int N>
__device__ void kq_gemv(const KqSegs& segs, const kq_u32* xq, const float2* xds, int n, int cols,
                        typename D::raw* out, kq_u64 out_stride) {
  kq_grid_enter();
  const int r = blockIdx.x * FC_KQ_ROWS_PER_BLOCK + (threadIdx.x >> 5);
  if (r >= segs.total_rows) return;
  const KqSeg sg = kq_segment(segs, r);
  float acc[N];
#pragma unroll
  for (int v = 0; v < N; ++v) acc[v] = 0.f;
  kq_row_any<N>(sg.type, sg.w + (kq_u64)(r - sg.row0) * sg.row_stride, xq, xds, cols / FC_KQ_CHUNK, n, acc);
#pragma unroll
  for (int v = 0; v < N; ++v) {
    const float sum = kq_warp_sum(acc[v]);
    if (v < n && (threadIdx.x & 31) == 0) out[v * out_stride + sg.out_col + (r - sg.row0)] = D::from_f(sum);
  }
}

// Pair p = token * topk + k reads expert topk_ids[p] (weights at w + expert * expert_stride) against the
// token's vector; out is [pairs, rows].
template <typename D>
__device__ void kq_moe_up(const kq_u8* w, kq_u64 expert_stride, kq_u64 row_stride, int type, int rows, int cols,
                          const int* topk_ids, int topk, const kq_u32* xq, const float2* xds,
                          typename D::raw* out) {
  kq_grid_enter();
  const int r = blockIdx.x * FC_KQ_ROWS_PER_BLOCK + (threadIdx.x >> 5), p = blockIdx.y;
  if (r >= rows) return;
  const int chunks = cols / FC_KQ_CHUNK;
  const kq_u8* row = w + (kq_u64)topk_ids[p] * expert_stride + (kq_u64)r * row_stride;
  const int token = p / topk;
  float acc[1] = {0.f};
  kq_row_any<1>(type, row, xq + (kq_u64)token * chunks * 8, xds + (kq_u64)token * chunks, chunks, 1, acc);
  const float sum = kq_warp_sum(acc[0]);
  if ((threadIdx.x & 31) == 0) out[(kq_u64)p * rows + r] = D::from_f(sum);
}

// Token t: out[t, r] = sum over k of topk_weights[t, k] * (row r of expert topk_ids[t, k]) . a[t * topk + k].
// The (k, chunk) steps are dealt to the lanes as one sequence, so a short row still keeps every lane busy;
// each lane's partials are weighted as they are made, then the warp adds them in its fixed tree.
// ``load(k, c, q, &ds)`` reads chunk c of the token's k-th activation row: from the quantize launch's rows
// (KqXRows) or from a block's stage (KqXStaged), so the two down forms share one arithmetic.
template <int T, typename X>
__device__ __forceinline__ float kq_moe_down_lane(const kq_u8* w, kq_u64 expert_stride, kq_u64 row_stride, int r,
                                                  int chunks, const int* ids, const float* weights, int topk,
                                                  const X& load) {
  float acc = 0.f;
#pragma unroll 2
  for (int s = threadIdx.x & 31; s < topk * chunks; s += 32) {
    const int k = s / chunks, c = s - k * chunks;
    KqChunk ch;
    kq_decode_chunk(T, w + (kq_u64)ids[k] * expert_stride + (kq_u64)r * row_stride, c, &ch);
    kq_u32 q[8];
    float2 ds;
    load(k, c, q, &ds);
    acc += weights[k] * kq_chunk_dot(ch, q, ds.x, ds.y);
  }
  return acc;
}

template <typename X>
__device__ __forceinline__ float kq_moe_down_any(int type, const kq_u8* w, kq_u64 expert_stride, kq_u64 row_stride,
                                                 int r, int chunks, const int* ids, const float* weights, int topk,
                                                 const X& load) {
  switch (type) {  // warp-uniform
    case FC_KQ_Q4_K:
      return kq_moe_down_lane<FC_KQ_Q4_K>(w, expert_stride, row_stride, r, chunks, ids, weights, topk, load);
    case FC_KQ_Q5_K:
      return kq_moe_down_lane<FC_KQ_Q5_K>(w, expert_stride, row_stride, r, chunks, ids, weights, topk, load);
    case FC_KQ_Q6_K:
      return kq_moe_down_lane<FC_KQ_Q6_K>(w, expert_stride, row_stride, r, chunks, ids, weights, topk, load);
    default:
      return kq_moe_down_lane<FC_KQ_Q8_0>(w, expert_stride, row_stride, r, chunks, ids, weights, topk, load);
  }
}

// The quantize launch's activation rows xq / xds (kq_load_x).
struct KqXRows {
  const kq_u32* xq;
  const float2* xds;
  int chunks;
  __device__ __forceinline__ void operator()(int v, int c, kq_u32 q[8], float2* ds) const {
    kq_load_x(xq, xds, chunks, v, c, q, ds);
  }
};

template <typename D>
__device__ void kq_moe_down(const kq_u8* w, kq_u64 expert_stride, kq_u64 row_stride, int type, int rows, int cols,
                            const int* topk_ids, const float* topk_weights, int topk, const kq_u32* xq,
                            const float2* xds, typename D::raw* out) {
  kq_grid_enter();
  const int r = blockIdx.x * FC_KQ_ROWS_PER_BLOCK + (threadIdx.x >> 5), t = blockIdx.y;
  if (r >= rows) return;
  const int chunks = cols / FC_KQ_CHUNK;
  const int* ids = topk_ids + (kq_u64)t * topk;
  const float* wt = topk_weights + (kq_u64)t * topk;
  // the token's topk activation rows, in k order
  const KqXRows a = {xq + (kq_u64)t * topk * chunks * 8, xds + (kq_u64)t * topk * chunks, chunks};
  const float sum = kq_warp_sum(kq_moe_down_any(type, w, expert_stride, row_stride, r, chunks, ids, wt, topk, a));
  if ((threadIdx.x & 31) == 0) out[(kq_u64)t * rows + r] = D::from_f(sum);
}

// ---- staged forms: the activations quantized once per block into shared memory --------------------------
// Why: the two-launch forms pay a kernel boundary for the quantization on every product (a few us each in a
// decode graph of ~1000 products), and read the activations through L1 beside the weights. A staged block
// quantizes all n rows (each chunk's 16-byte halves in two planes, so lane-consecutive chunks read
// conflict-free), then its warps take rows in a grid-stride loop: a grid of about two blocks per SM
// quantizes each activation row a few hundred times, from L2, against weights read once.
#define FC_KQ_STAGED_THREADS 512

struct KqStage {
  const uint4* qa;   // [n][chunks] values 0-15 of each chunk
  const uint4* qb;   // [n][chunks] values 16-31
  const float2* ds;  // [n][chunks] (scale, sum)
  int chunks;
};

// silu (block-uniform): the rows are [gate | up] of 2 cols values and the vector is silu(gate) * up, rounded as
// kq_quantize's SILU form rounds it, so a staged product's activations are the two-launch forms' bit for bit.
template <typename D>
__device__ KqStage kq_stage(const typename D::raw* x, int n, int cols, kq_u64 x_stride, uint4* smem,
                            bool silu = false) {
  typedef typename D::raw raw;
  const int chunks = cols / FC_KQ_CHUNK, total = n * chunks;
  uint4* qa = smem;
  uint4* qb = qa + total;
  float2* ds = reinterpret_cast<float2*>(qb + total);
  constexpr int LOADS = (int)(FC_KQ_CHUNK * sizeof(raw) / 16);
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int v = i / chunks, c = i - v * chunks;
    const uint4* src = reinterpret_cast<const uint4*>(x + v * x_stride + (kq_u64)c * FC_KQ_CHUNK);
    alignas(16) raw buf[FC_KQ_CHUNK];  // filled by 16-byte stores
    uint4* b = reinterpret_cast<uint4*>(buf);
#pragma unroll
    for (int k = 0; k < LOADS; ++k) b[k] = __ldg(src + k);  // rows 16-byte aligned
    float f[FC_KQ_CHUNK];
    if (silu) {
      alignas(16) raw up[FC_KQ_CHUNK];
      uint4* u = reinterpret_cast<uint4*>(up);
      const uint4* usrc = reinterpret_cast<const uint4*>(x + v * x_stride + cols + (kq_u64)c * FC_KQ_CHUNK);
#pragma unroll
      for (int k = 0; k < LOADS; ++k) u[k] = __ldg(usrc + k);
#pragma unroll
      for (int l = 0; l < FC_KQ_CHUNK; ++l) {
        const float gate = D::to_f(buf[l]), s = D::to_f(D::from_f(gate / (1.f + expf(-gate))));
        f[l] = D::to_f(D::from_f(s * D::to_f(up[l])));
      }
    } else {
#pragma unroll
      for (int l = 0; l < FC_KQ_CHUNK; ++l) f[l] = D::to_f(buf[l]);
    }
    kq_u32 q[8];
    float d, s;
    kq_quantize_chunk(f, q, &d, &s);
    qa[i] = make_uint4(q[0], q[1], q[2], q[3]);
    qb[i] = make_uint4(q[4], q[5], q[6], q[7]);
    ds[i] = make_float2(d, s);
  }
  __syncthreads();  // every row staged before any warp reads another thread's chunks
  KqStage st = {qa, qb, ds, chunks};
  return st;
}

// Chunk i (row v: i = v * chunks + c) of a stage.
__device__ __forceinline__ void kq_load_s(const KqStage& x, int i, kq_u32 q[8], float2* ds) {
  const uint4 a = x.qa[i], b = x.qb[i];
  q[0] = a.x; q[1] = a.y; q[2] = a.z; q[3] = a.w;
  q[4] = b.x; q[5] = b.y; q[6] = b.z; q[7] = b.w;
  *ds = x.ds[i];
}

// One warp, one row of type T, against staged vectors v0 .. v0 + n - 1 (n <= N).
template <int T, int N>
__device__ __forceinline__ void kq_row_s(const kq_u8* row, const KqStage& x, int v0, int n, float acc[N]) {
#pragma unroll 2
  for (int c = threadIdx.x & 31; c < x.chunks; c += 32) {
    KqChunk k;
    kq_decode_chunk(T, row, c, &k);
#pragma unroll
    for (int v = 0; v < N; ++v) {
      if (v < n) {
        kq_u32 q[8];
        float2 ds;
        kq_load_s(x, (v0 + v) * x.chunks + c, q, &ds);
        acc[v] += kq_chunk_dot(k, q, ds.x, ds.y);
      }
    }
  }
}

template <int N>
__device__ __forceinline__ void kq_row_s_any(int type, const kq_u8* row, const KqStage& x, int v0, int n,
                                             float acc[N]) {
  switch (type) {  // warp-uniform
    case FC_KQ_Q4_K: kq_row_s<FC_KQ_Q4_K, N>(row, x, v0, n, acc); break;
    case FC_KQ_Q5_K: kq_row_s<FC_KQ_Q5_K, N>(row, x, v0, n, acc); break;
    case FC_KQ_Q6_K: kq_row_s<FC_KQ_Q6_K, N>(row, x, v0, n, acc); break;
    default: kq_row_s<FC_KQ_Q8_0, N>(row, x, v0, n, acc); break;
  }
}

template <typename D, int N>
__device__ void kq_gemv_s(const KqSegs& segs, const typename D::raw* x, int n, int cols, kq_u64 x_stride,
                          typename D::raw* out, kq_u64 out_stride) {
  extern __shared__ uint4 kq_smem[];
  const int warps = blockDim.x >> 5, first = blockIdx.x * warps + (threadIdx.x >> 5);
  if (first < segs.total_rows) {  // this warp's first row on its way from DRAM while the block stages x
    const KqSeg sg = kq_segment(segs, first);
    kq_prefetch_row(sg.w + (kq_u64)(first - sg.row0) * sg.row_stride, kq_row_bytes(sg.type, cols));
  }
  kq_grid_enter();
  const KqStage xs = kq_stage<D>(x, n, cols, x_stride, kq_smem);
  for (int r = first; r < segs.total_rows; r += gridDim.x * warps) {
    const KqSeg sg = kq_segment(segs, r);
    float acc[N];
#pragma unroll
    for (int v = 0; v < N; ++v) acc[v] = 0.f;
    kq_row_s_any<N>(sg.type, sg.w + (kq_u64)(r - sg.row0) * sg.row_stride, xs, 0, n, acc);
#pragma unroll
    for (int v = 0; v < N; ++v) {
      const float sum = kq_warp_sum(acc[v]);
      if (v < n && (threadIdx.x & 31) == 0) out[v * out_stride + sg.out_col + (r - sg.row0)] = D::from_f(sum);
    }
  }
}

// ---- the MoE's pairs form, staged: two launches a layer instead of four ----------------------------------
// Why: at 1-2 tokens a layer's experts ran quantize, up, quantize-silu, down: two of the four launches only
// quantize (3.5 + 5.2 us of a ~40-node layer on an H100, bench/results/2026-12-06-h100x1-shard-tp8-profile-92412e6).
// Here each block stages the activations itself (kq_stage), then its warps take (pair, row) items of up, or
// (token, row) items of down, in a grid-stride loop. The arithmetic is kq_moe_up's / kq_moe_down's, chunk for
// chunk, so the outputs equal the pairs form's bit for bit.
template <typename D>
__device__ void kq_moe_up_s(const kq_u8* w, kq_u64 expert_stride, kq_u64 row_stride, int type, int rows, int cols,
                            const int* topk_ids, int topk, int tokens, const typename D::raw* x, kq_u64 x_stride,
                            typename D::raw* out) {
  extern __shared__ uint4 kq_smem[];
  const int warps = blockDim.x >> 5, items = tokens * topk * rows, first = blockIdx.x * warps + (threadIdx.x >> 5);
  kq_grid_enter();  // before the routes are read: a kernel wrote them
  if (first < items)  // this warp's first (pair, row) on its way while the block stages x (kq_prefetch_row)
    kq_prefetch_row(w + (kq_u64)topk_ids[first / rows] * expert_stride + (kq_u64)(first % rows) * row_stride,
                    kq_row_bytes(type, cols));
  const KqStage xs = kq_stage<D>(x, tokens, cols, x_stride, kq_smem);
  for (int i = first; i < items; i += gridDim.x * warps) {
    const int p = i / rows, r = i - p * rows;
    float acc[1] = {0.f};
    kq_row_s_any<1>(type, w + (kq_u64)topk_ids[p] * expert_stride + (kq_u64)r * row_stride, xs, p / topk, 1, acc);
    const float sum = kq_warp_sum(acc[0]);
    if ((threadIdx.x & 31) == 0) out[(kq_u64)p * rows + r] = D::from_f(sum);
  }
}

// A stage's rows from row v0 (kq_load_s): kq_moe_down_lane's activations in the staged form.
struct KqXStaged {
  KqStage s;
  int v0;
  __device__ __forceinline__ void operator()(int v, int c, kq_u32 q[8], float2* ds) const {
    kq_load_s(s, (v0 + v) * s.chunks + c, q, ds);
  }
};

// a [tokens * topk, cols] (silu: [.., 2 cols], vLLM's silu_and_mul applied while staging), out [tokens, rows].
template <typename D>
__device__ void kq_moe_down_s(const kq_u8* w, kq_u64 expert_stride, kq_u64 row_stride, int type, int rows, int cols,
                              const int* topk_ids, const float* topk_weights, int topk, int tokens,
                              const typename D::raw* a, kq_u64 a_stride, int silu, typename D::raw* out) {
  extern __shared__ uint4 kq_smem[];
  const int warps = blockDim.x >> 5, items = tokens * rows, first = blockIdx.x * warps + (threadIdx.x >> 5);
  kq_grid_enter();  // before the routes are read: a kernel wrote them
  if (first < items) {  // row r of each of this warp's first token's experts, while the block stages a
    const int t = first / rows, r = first - t * rows;
    for (int k = 0; k < topk; ++k)
      kq_prefetch_row(w + (kq_u64)topk_ids[(kq_u64)t * topk + k] * expert_stride + (kq_u64)r * row_stride,
                      kq_row_bytes(type, cols));
  }
  const KqStage as = kq_stage<D>(a, tokens * topk, cols, a_stride, kq_smem, silu != 0);
  for (int i = first; i < items; i += gridDim.x * warps) {
    const int t = i / rows, r = i - t * rows;
    const int* ids = topk_ids + (kq_u64)t * topk;
    const float* wt = topk_weights + (kq_u64)t * topk;
    const KqXStaged pairs = {as, t * topk};  // the token's pairs' rows of the stage
    const float sum = kq_warp_sum(kq_moe_down_any(type, w, expert_stride, row_stride, r, as.chunks, ids, wt, topk,
                                                  pairs));
    if ((threadIdx.x & 31) == 0) out[(kq_u64)t * rows + r] = D::from_f(sum);
  }
}

#define FC_KQ_DEFINE_GEMVS(NAME, D, N)                                                                       \
  extern "C" __global__ void __launch_bounds__(FC_KQ_STAGED_THREADS)                                         \
      fc_kq_gemvs##N##_##NAME(KqSegs segs, const D::raw* x, int n, int cols, kq_u64 x_stride, D::raw* out,  \
                              kq_u64 out_stride) {                                                           \
    kq_gemv_s<D, N>(segs, x, n, cols, x_stride, out, out_stride);                                            \
  }

#define FC_KQ_DEFINE_GEMV(NAME, D, N)                                                                        \
  extern "C" __global__ void __launch_bounds__(FC_KQ_THREADS)                                                \
      fc_kq_gemv##N##_##NAME(KqSegs segs, const kq_u32* xq, const float2* xds, int n, int cols,             \
                             D::raw* out, kq_u64 out_stride) {                                               \
    kq_gemv<D, N>(segs, xq, xds, n, cols, out, out_stride);                                                  \
  }

// The mma forms, one entry per weight type (V: _q4k ...) beside the one for any type (V empty: a switch).
#define FC_KQ_DEFINE_MMA(NAME, D, V, TT)                                                                     \
  extern "C" __global__ void __launch_bounds__(32 * FC_KQ_MMA_WARPS)                                         \
      fc_kq_mma##V##_##NAME(KqSegs segs, const kq_u32* xq, const float* xs, int n, int cols, D::raw* out,   \
                            kq_u64 out_stride) {                                                             \
    kq_mma_gemv<D, TT>(segs, xq, xs, n, cols, out, out_stride);                                              \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(32 * FC_KQ_MMA_WARPS)                                         \
      fc_kq_moe_mma_up##V##_##NAME(const kq_u8* w, kq_u64 expert_stride, kq_u64 row_stride, int type,        \
                                   int rows, int cols, const int* topk_ids, int topk, int pairs,             \
                                   int experts, const kq_u32* xq, const float* xs, D::raw* out) {            \
    kq_mma_moe<D, true, TT>(w, expert_stride, row_stride, type, rows, cols, topk_ids, topk, pairs, experts,  \
                            xq, xs, out);                                                                    \
  }

// A weight's segments dequantized into out [total_rows, cols] (row-major, the dtype): thread i decodes chunk
// i % chunks of row i / chunks (kq_dequant_chunk) and writes its 32 values as 16-byte stores, so a warp writes
// 32 adjacent chunks' bytes in whole sectors. Reads each weight byte once; the writes are the cost (bf16: 3.6x the
// bytes of Q4_K), which is why a prefill takes this form only from many tokens (kquant.prefill_form).
template <typename D>
__device__ void kq_dequant(KqSegs segs, int cols, typename D::raw* out) {
  typedef typename D::raw raw;
  kq_grid_enter();
  const int chunks = cols / FC_KQ_CHUNK;
  const kq_u64 i = (kq_u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (kq_u64)segs.total_rows * chunks) return;
  const int r = (int)(i / chunks), c = (int)(i - (kq_u64)r * chunks);
  const KqSeg sg = kq_segment(segs, r);
  float v[FC_KQ_CHUNK];
  kq_dequant_chunk(sg.type, sg.w + (kq_u64)(r - sg.row0) * sg.row_stride, c, v);
  raw vals[FC_KQ_CHUNK];
#pragma unroll
  for (int l = 0; l < FC_KQ_CHUNK; ++l) vals[l] = D::from_f(v[l]);
  uint4* to = reinterpret_cast<uint4*>(out + (kq_u64)r * cols + (kq_u64)c * FC_KQ_CHUNK);
  const uint4* from = reinterpret_cast<const uint4*>(vals);
#pragma unroll
  for (int j = 0; j < (int)(sizeof(vals) / sizeof(uint4)); ++j) to[j] = from[j];
}

#define FC_KQ_DEFINE(NAME, D)                                                                                \
  extern "C" __global__ void __launch_bounds__(256)                                                          \
      fc_kq_quantize_##NAME(const D::raw* x, int n, int cols, kq_u64 x_stride, kq_u32* xq, float2* xds,      \
                            int mma) {                                                                       \
    kq_quantize<D, false>(x, n, cols, x_stride, xq, xds, mma);                                               \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(256)                                                          \
      fc_kq_quantize_silu_##NAME(const D::raw* x, int n, int cols, kq_u64 x_stride, kq_u32* xq, float2* xds, \
                                 int mma) {                                                                  \
    kq_quantize<D, true>(x, n, cols, x_stride, xq, xds, mma);                                                \
  }                                                                                                          \
  FC_KQ_DEFINE_GEMV(NAME, D, 1)                                                                              \
  FC_KQ_DEFINE_GEMV(NAME, D, 2)                                                                              \
  FC_KQ_DEFINE_GEMV(NAME, D, 4)                                                                              \
  FC_KQ_DEFINE_GEMV(NAME, D, 8)                                                                              \
  FC_KQ_DEFINE_GEMVS(NAME, D, 1)                                                                             \
  FC_KQ_DEFINE_GEMVS(NAME, D, 2)                                                                             \
  FC_KQ_DEFINE_GEMVS(NAME, D, 4)                                                                             \
  FC_KQ_DEFINE_GEMVS(NAME, D, 8)                                                                             \
  FC_KQ_DEFINE_MMA(NAME, D, , FC_KQ_ANY)                                                                    \
  FC_KQ_DEFINE_MMA(NAME, D, _q4k, FC_KQ_Q4_K)                                                               \
  FC_KQ_DEFINE_MMA(NAME, D, _q5k, FC_KQ_Q5_K)                                                               \
  FC_KQ_DEFINE_MMA(NAME, D, _q6k, FC_KQ_Q6_K)                                                               \
  FC_KQ_DEFINE_MMA(NAME, D, _q80, FC_KQ_Q8_0)                                                               \
  extern "C" __global__ void __launch_bounds__(FC_KQ_THREADS)                                                \
      fc_kq_moe_up_##NAME(const kq_u8* w, kq_u64 expert_stride, kq_u64 row_stride, int type, int rows,       \
                          int cols, const int* topk_ids, int topk, const kq_u32* xq, const float2* xds,      \
                          D::raw* out) {                                                                     \
    kq_moe_up<D>(w, expert_stride, row_stride, type, rows, cols, topk_ids, topk, xq, xds, out);              \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(FC_KQ_THREADS)                                                \
      fc_kq_moe_down_##NAME(const kq_u8* w, kq_u64 expert_stride, kq_u64 row_stride, int type, int rows,     \
                            int cols, const int* topk_ids, const float* topk_weights, int topk,              \
                            const kq_u32* xq, const float2* xds, D::raw* out) {                              \
    kq_moe_down<D>(w, expert_stride, row_stride, type, rows, cols, topk_ids, topk_weights, topk, xq, xds,    \
                   out);                                                                                     \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(FC_KQ_STAGED_THREADS)                                         \
      fc_kq_moe_up_s_##NAME(const kq_u8* w, kq_u64 expert_stride, kq_u64 row_stride, int type, int rows,     \
                            int cols, const int* topk_ids, int topk, int tokens, const D::raw* x,            \
                            kq_u64 x_stride, D::raw* out) {                                                  \
    kq_moe_up_s<D>(w, expert_stride, row_stride, type, rows, cols, topk_ids, topk, tokens, x, x_stride, out); \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(FC_KQ_STAGED_THREADS)                                         \
      fc_kq_moe_down_s_##NAME(const kq_u8* w, kq_u64 expert_stride, kq_u64 row_stride, int type, int rows,   \
                              int cols, const int* topk_ids, const float* topk_weights, int topk,            \
                              int tokens, const D::raw* a, kq_u64 a_stride, int silu, D::raw* out) {         \
    kq_moe_down_s<D>(w, expert_stride, row_stride, type, rows, cols, topk_ids, topk_weights, topk, tokens, a, \
                     a_stride, silu, out);                                                                   \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(256)                                                          \
      fc_kq_moe_sum_##NAME(const float* y, const int* topk_ids, const float* topk_weights, int topk,         \
                           int experts, int tokens, int rows, D::raw* out) {                                 \
    kq_moe_sum<D>(y, topk_ids, topk_weights, topk, experts, tokens, rows, out);                              \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(256)                                                          \
      fc_kq_dequant_##NAME(KqSegs segs, int cols, D::raw* out) {                                             \
    kq_dequant<D>(segs, cols, out);                                                                          \
  }

// The grouped MoE's shared form (kq_mma_moe's SHARED), built for each weight type only.
#define FC_KQ_DEFINE_SHARED_UP(NAME, D, V, TT)                                                               \
  extern "C" __global__ void __launch_bounds__(32 * FC_KQ_MMA_WARPS)                                         \
      fc_kq_moe_mma_up_shared##V##_##NAME(const kq_u8* w, kq_u64 expert_stride, kq_u64 row_stride, int type, \
                                          int rows, int cols, const int* topk_ids, int topk, int pairs,      \
                                          int experts, const kq_u32* xq, const float* xs, D::raw* out) {     \
    kq_mma_moe<D, true, TT, true>(w, expert_stride, row_stride, type, rows, cols, topk_ids, topk, pairs,     \
                                  experts, xq, xs, out);                                                     \
  }
#define FC_KQ_DEFINE_SHARED(NAME, D)                                                                         \
  FC_KQ_DEFINE_SHARED_UP(NAME, D, _q4k, FC_KQ_Q4_K)                                                          \
  FC_KQ_DEFINE_SHARED_UP(NAME, D, _q5k, FC_KQ_Q5_K)                                                          \
  FC_KQ_DEFINE_SHARED_UP(NAME, D, _q6k, FC_KQ_Q6_K)                                                          \
  FC_KQ_DEFINE_SHARED_UP(NAME, D, _q80, FC_KQ_Q8_0)

FC_KQ_DEFINE(bf16, FcBF16)
FC_KQ_DEFINE(f16, FcF16)
FC_KQ_DEFINE(f32, FcF32)
FC_KQ_DEFINE_SHARED(bf16, FcBF16)
FC_KQ_DEFINE_SHARED(f16, FcF16)
FC_KQ_DEFINE_SHARED(f32, FcF32)

// The down rows' output is fp32 whatever the dtype (kq_moe_sum rounds once), so one entry serves all three.
#define FC_KQ_DEFINE_DOWN(V, TT)                                                                             \
  extern "C" __global__ void __launch_bounds__(32 * FC_KQ_MMA_WARPS)                                         \
      fc_kq_moe_mma_down##V(const kq_u8* w, kq_u64 expert_stride, kq_u64 row_stride, int type, int rows,     \
                            int cols, const int* topk_ids, int topk, int pairs, int experts,                 \
                            const kq_u32* xq, const float* xs, float* out) {                                 \
    kq_mma_moe<FcF32, false, TT>(w, expert_stride, row_stride, type, rows, cols, topk_ids, topk, pairs,      \
                                 experts, xq, xs, out);                                                      \
  }
FC_KQ_DEFINE_DOWN(, FC_KQ_ANY)
FC_KQ_DEFINE_DOWN(_q4k, FC_KQ_Q4_K)
FC_KQ_DEFINE_DOWN(_q5k, FC_KQ_Q5_K)
FC_KQ_DEFINE_DOWN(_q6k, FC_KQ_Q6_K)
FC_KQ_DEFINE_DOWN(_q80, FC_KQ_Q8_0)
#define FC_KQ_DEFINE_SHARED_DOWN(V, TT)                                                                      \
  extern "C" __global__ void __launch_bounds__(32 * FC_KQ_MMA_WARPS)                                         \
      fc_kq_moe_mma_down_shared##V(const kq_u8* w, kq_u64 expert_stride, kq_u64 row_stride, int type,        \
                                   int rows, int cols, const int* topk_ids, int topk, int pairs,             \
                                   int experts, const kq_u32* xq, const float* xs, float* out) {             \
    kq_mma_moe<FcF32, false, TT, true>(w, expert_stride, row_stride, type, rows, cols, topk_ids, topk, pairs, \
                                       experts, xq, xs, out);                                                \
  }
FC_KQ_DEFINE_SHARED_DOWN(_q4k, FC_KQ_Q4_K)
FC_KQ_DEFINE_SHARED_DOWN(_q5k, FC_KQ_Q5_K)
FC_KQ_DEFINE_SHARED_DOWN(_q6k, FC_KQ_Q6_K)
FC_KQ_DEFINE_SHARED_DOWN(_q80, FC_KQ_Q8_0)
