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
// (kquant.mma_warps): the most warps a tile for which every tile's block is resident at once, so a weight of
// few tiles (GLM-5's fused_qkv_a: 164) still has enough warps streaming it, and no launch runs a second, thin
// wave. Each warp's weights and activations arrive through its shared-memory ring (kq_mma_copy,
// kq_mma_xcopy). Operands: kq_unit_load / kq_unit_chunk / kq_xstage_ops / kq_xstage_scales' layout (kquant.cuh),
// the activations quantized first into the order the threads read (fc_kq_quantize with mma = 1).
#pragma once
#include "kquant.cuh"

#define FC_KQ_MMA_ROWS 16    // rows of a tile: the mma's M
#define FC_KQ_MMA_COLS 8     // activation vectors per pass: the mma's N
#define FC_KQ_MMA_WARPS 8    // the most warps splitting a tile's units (few tiles: more warps a tile)
#define FC_KQ_MAX_PAIRS 256  // (token, expert) pairs a grouped MoE launch routes
#define FC_KQ_MMA_STAGES 3   // units of a warp's rows in flight (its shared-memory ring)
#define FC_KQ_MMA_PART 512   // bytes of one warp's partial sums (4 x 32 floats) for warp 0 to add

// A block's dynamic shared memory: the partial sums of warps 1 .. W - 1 (FC_KQ_MMA_PART each), then each warp's
// ring. Why dynamic: a static array sized for FC_KQ_MMA_WARPS - 1 warps cost every one-warp block (the grouped
// MoE's, the LM head's) 3.5 KB it never used (a block an SM fewer; no time measurably lost or won on an H200).
extern __shared__ __align__(16) kq_u8 kq_mma_smem[];
__device__ __forceinline__ float (*kq_mma_part())[4][32] { return reinterpret_cast<float (*)[4][32]>(kq_mma_smem); }
__device__ __forceinline__ kq_u8* kq_mma_rings() { return kq_mma_smem + ((blockDim.x >> 5) - 1) * FC_KQ_MMA_PART; }

__device__ __forceinline__ void kq_mma_k32(const kq_u32 a[4], const kq_u32 b[2], int c[4]) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};"
      : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0), "r"(0), "r"(0), "r"(0));
}

// The weights reach the tensor cores through shared memory: each warp keeps FC_KQ_MMA_STAGES units of its
// 16 rows in flight with cp.async, a ring of stages. Why: loaded into registers, a unit's weights were
// waited for before its compute and the compiler sank any load issued ahead to the end of the loop, so a warp
// had one DRAM round trip in flight at a time and the kernels streamed at a third of the memory's rate
// (ncu: DRAM 27 %, 70 % of stalls on loads). A copy has no register to hold, so nothing moves it.
// A stage row is the 16-byte-aligned span that holds the row's unit (Q6_K / Q8_0 units are 2-byte aligned):
// chunks past the unit's last byte are not copied, so nothing is read past the weight's end.
__device__ constexpr int kq_mma_unit_bytes(int T) { return kq_block_bytes(T) * (FC_KQ_UNIT / kq_block_values(T)); }
// A span of 64 mod 128 bytes (Q5_K: 192) puts rows g and g + 2 of a warp's 8-byte reads on the same banks: such
// spans take 32 bytes more. Measured (H200, grouped MoE at 8 tokens, Q5_K down): 141.3 -> 139.5 us.
__device__ constexpr int kq_mma_span_raw(int T) { return (kq_mma_unit_bytes(T) + 15 + 15) / 16 * 16; }
__device__ constexpr int kq_mma_span(int T) { return kq_mma_span_raw(T) + (kq_mma_span_raw(T) % 128 == 64 ? 32 : 0); }

// 16 bytes from global into shared memory (`smem`: a shared-window address), asynchronously (a cp.async group).
// L1 = false: through L2 only (.cg), for the weights, which one warp streams once. L1 = true: through L1 (.ca),
// for the activations: the warps of an SM read the same ones (an expert's tokens, a linear's vectors), which L1
// then serves. With .cg for them too, L1's hit rate fell from 47 % to 0.3 % and the grouped MoE at 8 tokens took
// 256 us instead of 162 (H200, 2026-12-02 run s11).
template <bool L1>
__device__ __forceinline__ void kq_cp_async16(unsigned smem, const void* gmem) {
  if constexpr (L1) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(gmem) : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(gmem) : "memory");
  }
}
__device__ __forceinline__ void kq_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void kq_cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ unsigned kq_smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// A lane's copies, fixed for the whole tile: every unit's copies are these at the unit's offset. Why: with each
// piece's row, column and 64-bit address worked out again every unit, a unit's copies took ~135 of the unit's
// ~470 instructions (sm_90 SASS, grouped MoE up).
//   weights: piece i = l + 32k of the unit's 16 rows (row i / NC, piece i % NC of the row's span, NC pieces a
//   row), so one instruction's pieces lie in a few rows, contiguous: a lane per row instead (16 rows an
//   instruction) took the grouped MoE at 8 tokens from 162 to 175 us and o_proj from 26.8 to 30.4 (H200).
//   activations: lane l takes operand pieces l % 16 of slots l / 16 + 2k (k < 4), and float piece l % 4 of slot
//   l / 4 (Q6_K / Q8_0 have no sums: pieces 0-1 only)
template <int T>
struct KqCopies {
  static constexpr int NC = kq_mma_span(T) / 16, NK = (FC_KQ_MMA_ROWS * NC + 31) / 32;
  // Q4_K / Q5_K rows and units are 16-byte aligned (kquant.weights_aligned and ROW_ALIGN refuse other bases and
  // strides; their units are 144 and 176 bytes): a piece's source is then fixed relative to the unit's start.
  static constexpr bool ALIGNED = T == FC_KQ_Q4_K || T == FC_KQ_Q5_K;
  kq_u64 tile;
  unsigned w[NK];  // piece i's offset from the unit's start in the tile's first row (not ALIGNED: its row's)
  unsigned valid;  // bit k set where piece i is in the stage (ALIGNED: and holds bytes of the unit)
  kq_u64 x[4];     // the lane's operand pieces of unit 0 (slot l / 16 + 2k's vector)
  kq_u64 f;        // its float piece of unit 0
  unsigned xd[4];  // the operand pieces' places in a stage
  unsigned fd;     // the float piece's place
};

// The weight part of a lane's KqCopies for a tile of `rows` rows (rows past them read its last row again).
template <int T>
__device__ __forceinline__ void kq_copies_weights(KqCopies<T>* c, const kq_u8* tile, kq_u64 row_stride, int rows) {
  using C = KqCopies<T>;
  const int lane = threadIdx.x & 31;
  c->tile = (kq_u64)tile;
  c->valid = 0;
#pragma unroll
  for (int k = 0; k < C::NK; ++k) {
    const int i = lane + 32 * k, row = min(i / C::NC, rows - 1), piece = i % C::NC;
    c->w[k] = (unsigned)(row * row_stride) + (C::ALIGNED ? 16 * piece : 0);
    if (i < FC_KQ_MMA_ROWS * C::NC && (!C::ALIGNED || 16 * piece < kq_mma_unit_bytes(T))) c->valid |= 1u << k;
  }
}

// Unit u's weights into a stage (`stage`: its shared-window address). A row's unit is copied from the 16-byte
// boundary at or below its first byte (Q6_K / Q8_0 units are 2-byte aligned) through its last byte, so nothing is
// read past the weight's end. Piece i lands at 16 i: row i / NC at its span, piece i % NC in it.
template <int T>
__device__ __forceinline__ void kq_mma_copy(const KqCopies<T>& c, int u, unsigned stage) {
  using C = KqCopies<T>;
  constexpr int UB = kq_mma_unit_bytes(T);
  const int lane = threadIdx.x & 31;
  const kq_u64 base = c.tile + (kq_u64)u * UB;
#pragma unroll
  for (int k = 0; k < C::NK; ++k) {
    const int i = lane + 32 * k;
    if (!((c.valid >> k) & 1)) continue;
    if constexpr (C::ALIGNED) {
      kq_cp_async16<false>(stage + 16 * i, reinterpret_cast<const void*>(base + c.w[k]));
    } else {  // the unit's first byte moves within its 16 with u: whether the piece holds any of it is per unit
      const kq_u64 a = base + c.w[k];
      const int piece = i % C::NC;
      if (16 * piece < (int)(a & 15) + UB)
        kq_cp_async16<false>(stage + 16 * i, reinterpret_cast<const void*>((a & ~15ull) + 16 * piece));
    }
  }
}

// Unit u's activations into a stage's activation part (`xst`: its shared-window address; kq_xstage_op /
// kq_xstage_float).
template <bool MINS, int T>
__device__ __forceinline__ void kq_mma_xcopy(const KqCopies<T>& c, int u, unsigned xst) {
#pragma unroll
  for (int k = 0; k < 4; ++k)
    kq_cp_async16<true>(xst + c.xd[k], reinterpret_cast<const void*>(c.x[k] + (kq_u64)u * 256));
  if (MINS || (threadIdx.x & 2) == 0)
    kq_cp_async16<true>(xst + c.fd, reinterpret_cast<const void*>(c.f + (kq_u64)u * 64));
}

// One unit's products from a stage: the warp's rows g and g + 8 (their weights at `wst`, row g's unit from byte
// sa of its span, g + 8's from sb) against the 8 slots' activations at `xst`, added into acc.
template <int T>
__device__ __forceinline__ void kq_mma_unit(const kq_u8* wst, const kq_u8* xst, int sa, int sb, float acc[4]) {
  constexpr bool mins = T == FC_KQ_Q4_K || T == FC_KQ_Q5_K;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const kq_u32 first = t < 2 ? 0xFFFFFFFFu : 0u;  // Q6_K: this thread's values are in the chunk's first half
  KqUnit ua, ub;
  kq_unit_load(T, wst + g * kq_mma_span(T) + sa, 0, t, &ua);
  kq_unit_load(T, wst + (g + 8) * kq_mma_span(T) + sb, 0, t, &ub);
  KqXUnit x;
  float uacc[4] = {0.f, 0.f, 0.f, 0.f}, umin[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    if ((m & 3) == 0) kq_xstage_scales<mins>(xst, t, m >> 2, &x);
    if ((m & 1) == 0) kq_xstage_ops(xst, g, t, m >> 1, &x);
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

// One warp's share of a tile: rows g and g + 8 of the tile (rows past `rows` read its last row again), against
// the vectors of the pass's 8 slots, slot j's vector being lane 4j's `vop`. acc: row g with slots 2t and 2t + 1,
// then row g + 8 with the same. A stage holds a unit's weights and, after them, its activations; both are
// copied S - 1 units ahead, so the unit's compute reads shared memory only.
template <int T>
__device__ __forceinline__ void kq_mma_tile(const kq_u8* tile, kq_u64 row_stride, int rows, int units, int cols,
                                            int vop, const kq_u32* xq, const float* xs, float acc[4]) {
  constexpr bool mins = T == FC_KQ_Q4_K || T == FC_KQ_Q5_K;
  constexpr int UB = kq_mma_unit_bytes(T), WB = FC_KQ_MMA_ROWS * kq_mma_span(T), S = FC_KQ_MMA_STAGES;
  constexpr int STAGE = WB + FC_KQ_MMA_XSTAGE;
  const int lane = threadIdx.x & 31, g = lane >> 2, w = threadIdx.x >> 5, W = blockDim.x >> 5;
  kq_u8* ring = kq_mma_rings() + w * S * STAGE;
  const kq_u64 ra = (kq_u64)(tile + (kq_u64)min(g, rows - 1) * row_stride);
  const kq_u64 rb = (kq_u64)(tile + (kq_u64)min(g + 8, rows - 1) * row_stride);
  // This lane's copies (KqCopies): its slots' vectors come from the lanes holding them.
  KqCopies<T> c;
  kq_copies_weights<T>(&c, tile, row_stride, rows);
  {
    const int h = lane >> 4, p = lane & 15, j = lane >> 2, q = lane & 3;
    const kq_u8* xqb = reinterpret_cast<const kq_u8*>(xq);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      c.x[k] = (kq_u64)(xqb + (kq_u64)__shfl_sync(0xffffffffu, vop, 4 * (h + 2 * k)) * cols + 16 * p);
      c.xd[k] = WB + kq_xstage_op(h + 2 * k, p);
    }
    const kq_u8* xsb = reinterpret_cast<const kq_u8*>(xs);
    c.f = (kq_u64)(xsb + (kq_u64)__shfl_sync(0xffffffffu, vop, 4 * j) * (cols / 16) * 4 + 16 * q);
    c.fd = WB + kq_xstage_float(j, q);
  }
  const unsigned ring_sh = kq_smem_addr(ring);
  // The first stages' weights go out before the wait (no kernel writes them), their activations after it.
#pragma unroll
  for (int s = 0; s < S - 1; ++s)
    if (w + s * W < units) kq_mma_copy<T>(c, w + s * W, ring_sh + s * STAGE);
  kq_grid_wait();
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (w + s * W < units) kq_mma_xcopy<mins>(c, w + s * W, ring_sh + s * STAGE);
    kq_cp_commit();
  }
  int rd = 0, wr = S - 1;  // the stages of unit u and of unit u + (S - 1) W
  for (int u = w; u < units; u += W) {
    if (u + (S - 1) * W < units) {
      kq_mma_copy<T>(c, u + (S - 1) * W, ring_sh + wr * STAGE);
      kq_mma_xcopy<mins>(c, u + (S - 1) * W, ring_sh + wr * STAGE);
    }
    kq_cp_commit();
    kq_cp_wait<S - 1>();  // this lane's copies of unit u have landed; the warp's, after the sync
    __syncwarp();
    const kq_u8* stage = ring + rd * STAGE;
    rd = rd == S - 1 ? 0 : rd + 1;
    wr = wr == S - 1 ? 0 : wr + 1;
    // A row's unit starts in its stage row where it starts within its 16 bytes (0 for ALIGNED types).
    const int sa = KqCopies<T>::ALIGNED ? 0 : (int)((ra + (kq_u64)u * UB) & 15);
    const int sb = KqCopies<T>::ALIGNED ? 0 : (int)((rb + (kq_u64)u * UB) & 15);
    kq_mma_unit<T>(stage, stage + WB, sa, sb, acc);
    __syncwarp();  // every lane has read this stage before a later copy refills it
  }
  kq_cp_wait<0>();  // no copy outlives the warp's loop (the last units' groups are empty or already waited)
}

// The grouped MoE's "shared" form: the block's W warps each take their own tile and walk the same units in step,
// a unit's activations copied once into one ring for the block. Why: in kq_mma_tile each warp copies a unit's
// activations itself, as many bytes as its weights (2560 against 2304 for Q4_K), through L1 and L2 (ncu, H200,
// 2026-12-02 run s13: L2 75 % busy at DRAM 59 %). One barrier a unit replaces the warp's syncs.
//   thread i of the block copies operand pieces i + 32 W k (piece i % 16 of slot i / 16), and warp 0's lane l the
//   float piece l % 4 of slot l / 4 (Q6_K / Q8_0: pieces 0-1 only), each at `xd` / `fd` of a stage.
struct KqXShare {
  kq_u64 x[4];
  unsigned xd[4];
  int nx;         // operand pieces this thread copies: 4 / W
  kq_u64 f;
  unsigned fd;
  bool has_f;
};

// `vec(j)`: slot j's vector (its row of xq and xs).
template <bool MINS, typename V>
__device__ __forceinline__ KqXShare kq_xshare(V vec, const kq_u32* xq, const float* xs, int cols) {
  KqXShare c;
  const int tid = threadIdx.x, step = blockDim.x;
  const kq_u8* xqb = reinterpret_cast<const kq_u8*>(xq);
  c.nx = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int i = tid + step * k, j = i >> 4, p = i & 15;
    if (i < 128) {
      c.x[k] = (kq_u64)(xqb + (kq_u64)vec(j) * cols + 16 * p);
      c.xd[k] = kq_xstage_op(j, p);
      c.nx = k + 1;
    }
  }
  const int j = (tid & 31) >> 2, q = tid & 3;
  c.f = (kq_u64)(reinterpret_cast<const kq_u8*>(xs) + (kq_u64)vec(j) * (cols / 16) * 4 + 16 * q);
  c.fd = kq_xstage_float(j, q);
  c.has_f = tid < 32 && (MINS || q < 2);
  return c;
}

__device__ __forceinline__ void kq_mma_xcopy_shared(const KqXShare& c, int u, unsigned xst) {
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (k < c.nx) kq_cp_async16<true>(xst + c.xd[k], reinterpret_cast<const void*>(c.x[k] + (kq_u64)u * 256));
  if (c.has_f) kq_cp_async16<true>(xst + c.fd, reinterpret_cast<const void*>(c.f + (kq_u64)u * 64));
}

// Dynamic shared memory of the shared form: the warps' weight rings (S stages of 16 rows each), then the
// block's activation ring (S stages of FC_KQ_MMA_XSTAGE): kquant.moe_shared_smem.
template <int T>
__device__ __forceinline__ void kq_mma_tile_shared(const kq_u8* tile, kq_u64 row_stride, int rows, int units,
                                                   const KqXShare& xc, float acc[4]) {
  constexpr int UB = kq_mma_unit_bytes(T), WB = FC_KQ_MMA_ROWS * kq_mma_span(T), S = FC_KQ_MMA_STAGES;
  constexpr int XB = FC_KQ_MMA_XSTAGE;
  const int g = (threadIdx.x & 31) >> 2, w = threadIdx.x >> 5, W = blockDim.x >> 5;
  kq_u8* wring = kq_mma_smem + w * S * WB;
  kq_u8* xring = kq_mma_smem + W * S * WB;
  const kq_u64 ra = (kq_u64)(tile + (kq_u64)min(g, rows - 1) * row_stride);
  const kq_u64 rb = (kq_u64)(tile + (kq_u64)min(g + 8, rows - 1) * row_stride);
  KqCopies<T> c;
  kq_copies_weights<T>(&c, tile, row_stride, rows);
  const unsigned wsh = kq_smem_addr(wring), xsh = kq_smem_addr(xring);
#pragma unroll
  for (int s = 0; s < S - 1; ++s)
    if (s < units) kq_mma_copy<T>(c, s, wsh + s * WB);
  kq_grid_wait();
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < units) kq_mma_xcopy_shared(xc, s, xsh + s * XB);
    kq_cp_commit();
  }
  int rd = 0, wr = S - 1;  // the stages of unit u and of unit u + S - 1
  for (int u = 0; u < units; ++u) {  // block-uniform: every warp walks every unit
    kq_cp_wait<S - 2>();  // this thread's copies of unit u have landed
    // Everyone's have, and everyone has read unit u - 1's stage, which the copies below refill.
    __syncthreads();
    if (u + S - 1 < units) {
      kq_mma_copy<T>(c, u + S - 1, wsh + wr * WB);
      kq_mma_xcopy_shared(xc, u + S - 1, xsh + wr * XB);
    }
    kq_cp_commit();
    const int sa = KqCopies<T>::ALIGNED ? 0 : (int)((ra + (kq_u64)u * UB) & 15);
    const int sb = KqCopies<T>::ALIGNED ? 0 : (int)((rb + (kq_u64)u * UB) & 15);
    kq_mma_unit<T>(wring + rd * WB, xring + rd * XB, sa, sb, acc);
    rd = rd == S - 1 ? 0 : rd + 1;
    wr = wr == S - 1 ? 0 : wr + 1;
  }
  kq_cp_wait<0>();
}

// TT: the weight type a kernel is built for, or FC_KQ_ANY (a switch on `type`: its registers are the widest
// type's, and they set every type's occupancy).
#define FC_KQ_ANY (-1)
template <int TT>
__device__ __forceinline__ void kq_mma_tile_any(int type, const kq_u8* tile, kq_u64 row_stride, int rows, int cols,
                                                int vop, const kq_u32* xq, const float* xs, float acc[4]) {
  const int units = cols / FC_KQ_UNIT;
  if constexpr (TT != FC_KQ_ANY) {
    kq_mma_tile<TT>(tile, row_stride, rows, units, cols, vop, xq, xs, acc);
    return;
  }
  switch (type) {  // block-uniform: a tile lies in one segment
    case FC_KQ_Q4_K: kq_mma_tile<FC_KQ_Q4_K>(tile, row_stride, rows, units, cols, vop, xq, xs, acc); break;
    case FC_KQ_Q5_K: kq_mma_tile<FC_KQ_Q5_K>(tile, row_stride, rows, units, cols, vop, xq, xs, acc); break;
    case FC_KQ_Q6_K: kq_mma_tile<FC_KQ_Q6_K>(tile, row_stride, rows, units, cols, vop, xq, xs, acc); break;
    default: kq_mma_tile<FC_KQ_Q8_0>(tile, row_stride, rows, units, cols, vop, xq, xs, acc); break;
  }
}

// Warp 0's acc += the other warps' partials, in warp order; true on warp 0 (which then holds the tile's sums).
// Every thread of the block calls it (it synchronizes the block when there is more than one warp).
__device__ __forceinline__ bool kq_mma_reduce(float acc[4]) {
  float(*part)[4][32] = kq_mma_part();
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
template <typename D, int TT>
__device__ void kq_mma_gemv(const KqSegs& segs, const kq_u32* xq, const float* xs, int n, int cols,
                            typename D::raw* out, kq_u64 out_stride) {
  kq_grid_launch_dependents();  // and waits in kq_mma_tile, once its first weights are in flight
  const int r0 = blockIdx.x * FC_KQ_MMA_ROWS, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const KqSeg sg = kq_segment(segs, r0);  // the host keeps segment starts on tile boundaries
  const int last = segs.total_rows - 1;    // a last partial tile reads its last row again, writes nothing
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  kq_mma_tile_any<TT>(sg.type, sg.w + (kq_u64)(r0 - sg.row0) * sg.row_stride, sg.row_stride,
                      min(FC_KQ_MMA_ROWS, last + 1 - r0), cols, min(g, n - 1), xq, xs, acc);
  if (!kq_mma_reduce(acc)) return;
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

// Grouped MoE: block (tile, expert e) reads the tile of its expert's weight (rows of w + e * expert_stride) once
// per 8 pairs routed to it. UP: vector = the pair's token (xq: one row per token), out [pairs][rows] in the dtype;
// else vector = the pair itself (xq: one row per pair), out [pairs][rows] in fp32 (kq_moe_sum weights and adds
// them). A pair whose expert is outside [0, experts) is written by none and read by none.
// The grid's rows: one an expert (e = blockIdx.y) where there are at least as many pairs as experts; else one a
// pair (gridDim.y = pairs < experts), the row of an expert's first pair serving it and the others leaving at
// once: a decode step's few pairs then launch blocks for the experts they use, not for all (GLM-5's 256: at 4
// tokens of top 8, 224 of every 256 rows would find no pair).
// SHARED: the shared form (kq_mma_tile_shared): block (x, expert) holds tiles W x .. W x + W - 1, a warp each.
template <typename D, bool UP, int TT, bool SHARED = false>
__device__ void kq_mma_moe(const kq_u8* w, kq_u64 expert_stride, kq_u64 row_stride, int type, int rows, int cols,
                           const int* topk_ids, int topk, int pairs, int experts, const kq_u32* xq,
                           const float* xs, void* out) {
  static_assert(!SHARED || TT != FC_KQ_ANY, "the shared form is built for one weight type");
  __shared__ int s_pair[FC_KQ_MAX_PAIRS];
  __shared__ unsigned s_mask[FC_KQ_MAX_PAIRS / 32];
  // The routes are a kernel's output, and no weight is fetched before them: a real model's 256 experts leave
  // most blocks without a token at decode, whose weights would be read for nothing.
  kq_grid_enter();
  int e = blockIdx.y;
  if ((int)gridDim.y < experts) {  // a row a pair: block-uniform
    e = __ldg(topk_ids + blockIdx.y);
    bool earlier = false;
    for (int j = threadIdx.x; j < (int)blockIdx.y; j += blockDim.x) earlier |= __ldg(topk_ids + j) == e;
    if (__syncthreads_or(earlier) || e < 0 || e >= experts) return;
  }
  const int count = kq_route(topk_ids, pairs, e, s_pair, s_mask);
  const int tile_i = SHARED ? blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5) : blockIdx.x;
  const int r0 = tile_i * FC_KQ_MMA_ROWS, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // A shared block's warp past the rows reads the last row (its sums are written nowhere).
  const int rtile = SHARED ? min(r0, rows - 1) : r0;
  const kq_u8* tile = w + (kq_u64)e * expert_stride + (kq_u64)rtile * row_stride;
  for (int base = 0; base < count; base += FC_KQ_MMA_COLS) {  // block-uniform; one pass unless > 8 pairs
    const int n = min(count - base, FC_KQ_MMA_COLS);
    auto vec = [&](int j) {
      const int p = s_pair[base + min(j, n - 1)];
      return UP ? p / topk : p;
    };
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    bool writes;
    if constexpr (SHARED) {
      constexpr bool mins = TT == FC_KQ_Q4_K || TT == FC_KQ_Q5_K;
      kq_mma_tile_shared<TT>(tile, row_stride, min(FC_KQ_MMA_ROWS, rows - rtile), cols / FC_KQ_UNIT,
                             kq_xshare<mins>(vec, xq, xs, cols), acc);
      writes = true;
    } else {
      kq_mma_tile_any<TT>(type, tile, row_stride, min(FC_KQ_MMA_ROWS, rows - r0), cols, vec(g), xq, xs, acc);
      writes = kq_mma_reduce(acc);
    }
    if (writes) {
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
    // warp 0 has read `part` (shared: every warp has read the activation ring) before the next pass writes it
    if (base + FC_KQ_MMA_COLS < count) __syncthreads();
  }
}

// out[t, r] = sum over k of topk_weights[t, k] * y[t * topk + k, r], in k order; a pair routed outside
// [0, experts) adds nothing.
template <typename D>
__device__ void kq_moe_sum(const float* y, const int* topk_ids, const float* topk_weights, int topk, int experts,
                           int tokens, int rows, typename D::raw* out) {
  kq_grid_enter();
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
