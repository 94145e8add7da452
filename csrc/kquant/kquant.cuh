// Decode-time products of GGUF K-quant weights with a few activation vectors (batch 1-8: a decode step,
// an MTP verify step): the dense GEMV and the MoE GEMV over (token, expert) pairs.
//
// Why our own: vllm-gguf-plugin 0.0.5's mmvq/moe_vec kernels give each row one 32-thread block, move 4-8
// bytes per thread per step and read the weights once per vector (above 2 vectors its large linears take a
// GEMM kernel); on an H200 a GLM-5 o_proj (56.6 MB of Q4_K) took 38 us for one token and 173 us for four.
// Here a warp owns a row and each lane one 32-value chunk of it at a time, with 16-byte loads (4-byte loads
// where a block type is only 2-byte aligned), and every loaded weight meets all the vectors of the call.
//
// Numerics as llama.cpp's (and the plugin's): activations are quantized to int8 per 32 values (scale and
// the chunk's exact fp32 sum kept), the products are dp4a integer dots scaled in fp32, one fixed order.
//
// The chunk math below is plain C++ on purpose: under a host compiler (tests/gguf/test_kquant_host.py
// builds it with g++) the same functions run on the CPU against gguf-py's dequantization. No CUDA headers.
#pragma once

#if defined(__CUDACC__)
#define FC_KQ_HD __host__ __device__ __forceinline__
typedef unsigned long long kq_u64;
typedef unsigned int kq_u32;
typedef unsigned short kq_u16;
typedef unsigned char kq_u8;
typedef signed char kq_i8;
#else
#include <cstdint>
#include <cstring>
#define FC_KQ_HD inline
typedef uint64_t kq_u64;
typedef uint32_t kq_u32;
typedef uint16_t kq_u16;
typedef uint8_t kq_u8;
typedef int8_t kq_i8;
#endif

// ggml's type ids (gguf.GGMLQuantizationType) of the types these kernels read.
#define FC_KQ_Q8_0 8
#define FC_KQ_Q4_K 12
#define FC_KQ_Q5_K 13
#define FC_KQ_Q6_K 14
#define FC_KQ_CHUNK 32  // values per activation scale and per lane step
#define FC_KQ_UNIT 256  // values of a K-quant super-block (eight Q8_0 blocks): the mma forms' step along a row
#define FC_KQ_MAX_VECS 8
#define FC_KQ_MAX_SEGS 4
#define FC_KQ_ROWS_PER_BLOCK 4  // one warp per row
#define FC_KQ_THREADS (32 * FC_KQ_ROWS_PER_BLOCK)

// Bytes of one block and values in it, per type (gguf.GGML_QUANT_SIZES).
FC_KQ_HD constexpr int kq_block_bytes(int type) {
  return type == FC_KQ_Q4_K ? 144 : type == FC_KQ_Q5_K ? 176 : type == FC_KQ_Q6_K ? 210 : type == FC_KQ_Q8_0 ? 34 : 0;
}
FC_KQ_HD constexpr int kq_block_values(int type) { return type == FC_KQ_Q8_0 ? 32 : 256; }
FC_KQ_HD constexpr kq_u64 kq_row_bytes(int type, int cols) {
  return (kq_u64)(cols / kq_block_values(type)) * kq_block_bytes(type);
}

// Line m of the bytes [p, p + n) for an L2 prefetch (kq_prefetch_row): p itself for m = 0, else the m-th
// 128-byte line after the one holding p; 0 past the last line. Every address lies inside [p, p + n), so a
// prefetch never names a byte outside the row (the first line's base may lie before p).
#define FC_KQ_LINE 128
FC_KQ_HD kq_u64 kq_row_line(kq_u64 p, kq_u64 n, int m) {
  const kq_u64 a = m == 0 ? p : (p & ~(kq_u64)(FC_KQ_LINE - 1)) + (kq_u64)m * FC_KQ_LINE;
  return n > 0 && a < p + n ? a : 0;
}

// Row segments of one weight: rows [row0, row0 + rows) of the launch read `w` (row i at w + i * row_stride,
// so a plugin's padded multi-shard tensor is read in place) as `type`, into output columns from out_col.
struct KqSeg {
  const kq_u8* w;
  kq_u64 row_stride;
  int type, rows, row0, out_col;
};
struct KqSegs {
  KqSeg s[FC_KQ_MAX_SEGS];
  int nseg, total_rows;
};

// The segment holding row r, read with constant indices only (a dynamic index would copy the table to local
// memory).
FC_KQ_HD KqSeg kq_segment(const KqSegs& segs, int r) {
  KqSeg sg = segs.s[0];
  sg.row0 = 0;
#pragma unroll
  for (int i = 1; i < FC_KQ_MAX_SEGS; ++i) {
    if (i < segs.nseg && r >= segs.s[i].row0) {
      sg.w = segs.s[i].w, sg.row_stride = segs.s[i].row_stride, sg.type = segs.s[i].type;
      sg.row0 = segs.s[i].row0, sg.out_col = segs.s[i].out_col;
    }
  }
  return sg;
}

// ---- kernel boundaries (device only) -----------------------------------------------------------------------
// Programmatic dependent launch (sm_90+): a kernel may start while the kernel before it in the stream is still
// running. Why: a tensor-core product follows its activations' quantize launch, and that boundary cost it its
// launch and its first DRAM round trip (2-3 us of a 10-35 us product at 8 tokens). The host launches only the
// dense mma form so (kquant.dependent_launch: elsewhere it measured no gain), but every kernel here is safe
// to launch so: each lets the next one launch as it starts
// (kq_grid_launch_dependents: the next is scheduled once all of this grid's blocks have run it, so it never
// takes an SM from a block of this grid), and waits (kq_grid_wait: until the kernel before has finished and its
// writes are visible) before it reads anything a kernel wrote or writes anything; only weights, which no
// kernel writes, are read before (the dense mma form's first stages). Launched without the attribute, both are
// no-ops; older targets compile neither.
#if defined(__CUDACC__)
__device__ __forceinline__ void kq_grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void kq_grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// The start of a kernel that reads nothing before it waits.
__device__ __forceinline__ void kq_grid_enter() {
  kq_grid_launch_dependents();
  kq_grid_wait();
}

// Ask L2 for a weight row, lines lane, lane + 32, ... (a warp's call: each lane its lines). Why: a staged
// kernel quantizes the activations into shared memory before its warps read a weight, so without this its
// first weights' DRAM round trip starts only after that prologue; issued first, it runs under it. A hint: it
// changes no result, and no kernel writes weights, so it may go before kq_grid_wait.
__device__ __forceinline__ void kq_prefetch_row(const kq_u8* row, kq_u64 bytes) {
  for (int m = threadIdx.x & 31;; m += 32) {
    const kq_u64 a = kq_row_line((kq_u64)row, bytes, m);
    if (!a) break;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
  }
}
#endif

// ---- primitives with a host twin ---------------------------------------------------------------------------

FC_KQ_HD int kq_dp4a(int a, int b, int c) {
#if defined(__CUDA_ARCH__)
  return __dp4a(a, b, c);
#else
  for (int i = 0; i < 4; ++i) c += (int)(kq_i8)(a >> (8 * i)) * (int)(kq_i8)(b >> (8 * i));
  return c;
#endif
}

FC_KQ_HD kq_u32 kq_funnel_r(kq_u32 lo, kq_u32 hi, int shift) {  // low word of (hi:lo) >> shift, shift < 32
#if defined(__CUDA_ARCH__)
  return __funnelshift_r(lo, hi, shift);
#else
  return (kq_u32)((((kq_u64)hi << 32) | lo) >> shift);
#endif
}

// Q6_K's 6-bit values (0-63, a byte each) minus 32 as int8 bytes: + 96 carries out of no byte (at most 159),
// and flipping the top bit takes 128 off. Two operations where a per-byte subtraction takes several.
FC_KQ_HD kq_u32 kq_q6_signed(kq_u32 v) { return (v + 0x60606060u) ^ 0x80808080u; }

FC_KQ_HD float kq_half(kq_u32 bits) {  // IEEE half (low 16 bits) to float
#if defined(__CUDA_ARCH__)
  float f;
  unsigned short h = (unsigned short)bits;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  kq_u32 h = bits & 0xFFFF, sign = (h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF, out;
  if (exp == 0x1F) {
    out = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    out = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    out = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400));
    out = sign | ((kq_u32)(112 - e) << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  memcpy(&f, &out, 4);
  return f;
#endif
}

// Loads: SHARED = false reads global memory by the read-only path (__ldg); true reads through a generic
// pointer (the mma forms' weights, staged in shared memory, where __ldg must not go).
template <bool SHARED = false>
FC_KQ_HD void kq_load16(const kq_u8* p, kq_u32 w[4]) {  // p 16-byte aligned
#if defined(__CUDA_ARCH__)
  const uint4 v = SHARED ? *reinterpret_cast<const uint4*>(p) : __ldg(reinterpret_cast<const uint4*>(p));
  w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
#else
  memcpy(w, p, 16);
#endif
}

template <bool SHARED = false>
FC_KQ_HD void kq_load8(const kq_u8* p, kq_u32 w[2]) {  // p 8-byte aligned
#if defined(__CUDA_ARCH__)
  const uint2 v = SHARED ? *reinterpret_cast<const uint2*>(p) : __ldg(reinterpret_cast<const uint2*>(p));
  w[0] = v.x; w[1] = v.y;
#else
  memcpy(w, p, 8);
#endif
}

template <bool SHARED = false>
FC_KQ_HD kq_u32 kq_load_word(const kq_u8* p) {  // p 4-byte aligned
#if defined(__CUDA_ARCH__)
  return SHARED ? *reinterpret_cast<const unsigned int*>(p) : __ldg(reinterpret_cast<const unsigned int*>(p));
#else
  kq_u32 w;
  memcpy(&w, p, 4);
  return w;
#endif
}

// N words starting at a 2-byte aligned address (Q6_K's 210-byte and Q8_0's 34-byte blocks are no better
// aligned): N + 1 aligned word loads and a funnel shift. The extra word never leaves the 4-byte word that
// holds the last byte asked for.
template <int N, bool SHARED = false>
FC_KQ_HD void kq_load_even(const kq_u8* p, kq_u32 w[N]) {
  const kq_u64 a = (kq_u64)p;
  const kq_u8* base = p - (a & 3);
  const int shift = (int)(a & 3) * 8;
  kq_u32 lo = kq_load_word<SHARED>(base);
  for (int i = 0; i < N; ++i) {
    const kq_u32 hi = (shift || i + 1 < N) ? kq_load_word<SHARED>(base + 4 * (i + 1)) : 0u;
    w[i] = shift ? kq_funnel_r(lo, hi, shift) : lo;
    lo = hi;
  }
}

// Q4_K / Q5_K 6-bit scale and min of sub-block j (0-7) from the 12 scale bytes q[] at header bytes 4-15:
// j < 4: sc = q[j] & 63, m = q[j + 4] & 63; j >= 4: sc = (q[j + 4] & 15) | (q[j - 4] >> 6) << 4,
// m = (q[j + 4] >> 4) | (q[j] >> 6) << 4. Byte j % 4 of header words 1-3 serves both halves, so the lanes of
// a block (j = 0-7 side by side) take one path with selects instead of diverging.
FC_KQ_HD void kq_scale_min_k4(const kq_u32* header, int j, int* sc, int* m) {
  const int shift = 8 * (j & 3);
  const int b1 = (int)((header[1] >> shift) & 0xFF), b2 = (int)((header[2] >> shift) & 0xFF),
            b3 = (int)((header[3] >> shift) & 0xFF);
  const bool low = j < 4;
  *sc = low ? (b1 & 63) : ((b3 & 0xF) | ((b1 >> 6) << 4));
  *m = low ? (b2 & 63) : ((b3 >> 4) | ((b2 >> 6) << 4));
}

// ---- one chunk: 32 consecutive values of a row ----------------------------------------------------------
// A chunk decodes to 8 words of packed 8-bit weights (value l of the chunk in byte l % 4 of word l / 4, as
// the activations are packed) and its affine form: dot(w, x) = mul * sum_i dp4a(...) * xd - sub * xs, or for
// Q6_K two scales over the chunk's halves.
struct KqChunk {
  kq_u32 q[8];
  float mul_lo, mul_hi;  // scale of the integer dot over values 0-15 and 16-31 (equal unless Q6_K)
  float sub;             // times the activations' sum (Q4_K / Q5_K mins)
};

FC_KQ_HD void kq_decode_chunk(int type, const kq_u8* row, int c, KqChunk* k) {
  if (type == FC_KQ_Q4_K || type == FC_KQ_Q5_K) {
    // d, dmin, scales[12] | (Q5_K: qh[32]) | qs[128]: sub-block j takes the low (even j) or high nibbles of
    // qs[32 (j / 2) ...], and (Q5_K) bit j of each qh byte as its fifth bit.
    const int j = c & 7, pair = j >> 1, nib = (j & 1) * 4;
    const kq_u8* b = row + (kq_u64)(c >> 3) * kq_block_bytes(type);
    kq_u32 h[4], lo[8];
    kq_load16(b, h);
    const kq_u8* qs = b + (type == FC_KQ_Q5_K ? 48 : 16) + 32 * pair;
    kq_load16(qs, lo);
    kq_load16(qs + 16, lo + 4);
    int sc, m;
    kq_scale_min_k4(h, j, &sc, &m);
    if (type == FC_KQ_Q5_K) {
      kq_u32 qh[8];
      kq_load16(b + 16, qh);
      kq_load16(b + 32, qh + 4);
      for (int i = 0; i < 8; ++i) k->q[i] = ((lo[i] >> nib) & 0x0F0F0F0Fu) | (((qh[i] >> j) & 0x01010101u) << 4);
    } else {
      for (int i = 0; i < 8; ++i) k->q[i] = (lo[i] >> nib) & 0x0F0F0F0Fu;
    }
    k->mul_lo = k->mul_hi = kq_half(h[0]) * (float)sc;
    k->sub = kq_half(h[0] >> 16) * (float)m;
  } else if (type == FC_KQ_Q6_K) {
    // ql[128] qh[64] scales[16] (int8) d: value 128 h + 32 g + l takes nibble g / 2 of ql[64 h + 32 (g % 2) + l],
    // bits 2 g of qh[32 h + l], minus 32, and scale 8 h + 2 g + l / 16.
    const int j = c & 7, h = j >> 2, g = j & 3;
    const kq_u8* b = row + (kq_u64)(c >> 3) * 210;
    kq_u32 ql[8], qh[8], sc[1], d[1];
    kq_load_even<8>(b + 64 * h + 32 * (g & 1), ql);
    kq_load_even<8>(b + 128 + 32 * h, qh);
    kq_load_even<1>(b + 192 + 8 * h + 2 * g, sc);
    kq_load_even<1>(b + 208, d);
    const int nib = (g >> 1) * 4, hs = 2 * g;
    for (int i = 0; i < 8; ++i)
      k->q[i] = kq_q6_signed(((ql[i] >> nib) & 0x0F0F0F0Fu) | (((qh[i] >> hs) & 0x03030303u) << 4));
    const float dd = kq_half(d[0]);
    k->mul_lo = dd * (float)(kq_i8)(sc[0] & 0xFF);
    k->mul_hi = dd * (float)(kq_i8)((sc[0] >> 8) & 0xFF);
    k->sub = 0.f;
  } else {  // FC_KQ_Q8_0: d, qs[32] (int8)
    const kq_u8* b = row + (kq_u64)c * 34;
    kq_u32 d[1];
    kq_load_even<1>(b, d);
    kq_load_even<8>(b + 2, k->q);
    k->mul_lo = k->mul_hi = kq_half(d[0]);
    k->sub = 0.f;
  }
}

// The chunk's 32 weights as floats, value l = mul * q_l - sub as ggml dequantizes them (d * sc * q - dmin * m,
// the same fp32 operations in the same order): q_l is byte l of the decode, signed for Q6_K and Q8_0.
FC_KQ_HD void kq_dequant_chunk(int type, const kq_u8* row, int c, float v[FC_KQ_CHUNK]) {
  KqChunk k;
  kq_decode_chunk(type, row, c, &k);
  const bool is_signed = type == FC_KQ_Q6_K || type == FC_KQ_Q8_0;
  for (int l = 0; l < FC_KQ_CHUNK; ++l) {
    const kq_u32 b = (k.q[l >> 2] >> (8 * (l & 3))) & 0xFF;
    const int q = is_signed ? (int)(kq_i8)b : (int)b;
    v[l] = (l < 16 ? k.mul_lo : k.mul_hi) * (float)q - k.sub;
  }
}

// The chunk against one quantized activation chunk (8 words of int8, its scale xd and exact sum xs).
FC_KQ_HD float kq_chunk_dot(const KqChunk& k, const kq_u32* xq, float xd, float xs) {
  int lo = 0, hi = 0;
  for (int i = 0; i < 4; ++i) lo = kq_dp4a((int)k.q[i], (int)xq[i], lo);
  for (int i = 4; i < 8; ++i) hi = kq_dp4a((int)k.q[i], (int)xq[i], hi);
  return xd * (k.mul_lo * (float)lo + k.mul_hi * (float)hi) - k.sub * xs;
}

// Activation chunk: int8 q = round(x / d), d = max|x| / 127 (0 for an all-zero chunk), s = sum x in fp32.
FC_KQ_HD void kq_quantize_chunk(const float* x, kq_u32 q[8], float* d, float* s) {
  float amax = 0.f, sum = 0.f;
  for (int l = 0; l < FC_KQ_CHUNK; ++l) {
    const float a = x[l] < 0.f ? -x[l] : x[l];
    amax = a > amax ? a : amax;
    amax = a != a ? a : amax;  // NaN stays NaN, so the products are NaN too, never silently finite
    sum += x[l];
  }
  const float dd = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int i = 0; i < 8; ++i) {
    kq_u32 w = 0;
    for (int b = 0; b < 4; ++b) {
      float v = x[4 * i + b] * inv;
      v = v > 127.f ? 127.f : v < -127.f ? -127.f : v;
#if defined(__CUDA_ARCH__)
      const int r = __float2int_rn(v);
#else
      const float t = v < 0.f ? -v : v;
      float r0 = (float)(int)(t + 0.5f);
      if (r0 - t == 0.5f && ((int)r0 & 1)) r0 -= 1.f;  // ties to even, as cvt.rni
      const int r = (int)(v < 0.f ? -r0 : r0);
#endif
      w |= ((kq_u32)(r & 0xFF)) << (8 * b);
    }
    q[i] = w;
  }
  *d = dd;
  *s = sum;
}

// ---- tensor-core operands: the part of a unit one thread feeds to mma.sync, and its scales --------------
// The mma forms (kquant_mma.cuh) multiply a 16-row tile by up to 8 activation vectors with int8 mma.sync
// m16n8k32, one per 32-value chunk. Thread (g, t) of a warp (g = lane / 4, t = lane % 4) gives rows g and
// g + 8 the int8 operands of k-ints t and 4 + t, and vector g's operands at the same k-ints. Which of a chunk's
// values stand at a k-int is free, so long as the activations make the same choice (an integer dot is exact in
// any order): values 8t .. 8t + 7, for every type, so each thread reads one 8-byte piece of a row per chunk.
// Q6_K has a scale per 16 values: threads 0-1 then hold the chunk's first half and 2-3 its second, and two mma
// whose activation operands are masked to one half give each half's dot.
//
// Scaling: a chunk's dot is scaled by the weight's integer sub-block scale (sc * dot < 2^24 for every type:
// float-exact), times the activation's scale in fp32, and the super-block's float scales are applied once per
// 256-value unit: fewer instructions per weight byte (Q4_K: 368 a 16-row unit, was ~590; on an H200 that bought
// ~10 %, the kernels being bound by load latency more than by issue).
struct KqFrag {
  kq_u32 q[2];  // the operand words: values 8t .. 8t + 3 and 8t + 4 .. 8t + 7 of the chunk
  int sc[2];    // integer scale of the dot (Q6_K: of the first and of the second half)
  int mn;       // Q4_K / Q5_K: the integer min, times the activation chunk's sum
  float dm;     // Q8_0: the block's scale (no super-block)
};

// A thread's words of one 256-value unit of a row (a super-block; eight Q8_0 blocks), loaded once per unit
// so that its 8 chunks decode from registers (a header or a byte group serves several chunks).
//   Q4_K: header (d, dmin, scales) w[0..3], then per sub-block pair p its qs bytes 8t .. 8t + 7: w[4 + 2p ..]
//   Q5_K: header w[0..3], qh bytes 8t .. 8t + 7: w[4..5], qs per pair: w[6 + 2p ..]
//         both: the 6-bit scales of sub-blocks 0-3 and 4-7 as bytes in w[20], w[21], the mins in w[22], w[23]
//   Q6_K: ql bytes 64 h + 32 a + 8t .. + 7 (half-block h, a = g % 2 of chunk 4 h + g): w[2 (2 h + a) ..];
//         qh bytes 128 + 32 h + 8t .. + 7: w[8 + 2 h ..]; the 16 int8 scales: w[12..15]; d: w[16]
//   Q8_0: block m: d w[3 m], bytes 8t .. 8t + 7 of its values w[3 m + 1 ..]
#define FC_KQ_UNIT_WORDS 24
struct KqUnit {
  kq_u32 w[FC_KQ_UNIT_WORDS];
};

// `row`: the unit's row (global memory on the host, the kernel's shared-memory stage on the GPU).
FC_KQ_HD void kq_unit_load(int type, const kq_u8* row, int u, int t, KqUnit* r) {
  kq_u32* w = r->w;
  if (type == FC_KQ_Q4_K || type == FC_KQ_Q5_K) {
    const kq_u8* b = row + (kq_u64)u * kq_block_bytes(type);
    kq_load16<true>(b, w);
    const int qs = type == FC_KQ_Q5_K ? 6 : 4;
    if (type == FC_KQ_Q5_K) kq_load8<true>(b + 16 + 8 * t, w + 4);
    for (int p = 0; p < 4; ++p) kq_load8<true>(b + (type == FC_KQ_Q5_K ? 48 : 16) + 32 * p + 8 * t, w + qs + 2 * p);
    // kq_scale_min_k4 for all 8 sub-blocks at once, a byte each: j < 4 from bytes j of words 1 (scale) and 2
    // (min); j >= 4 their top 2 bits over the low (scale) or high (min) nibble of byte j - 4 of word 3.
    w[20] = w[1] & 0x3F3F3F3Fu;
    w[21] = (w[3] & 0x0F0F0F0Fu) | ((w[1] >> 2) & 0x30303030u);
    w[22] = w[2] & 0x3F3F3F3Fu;
    w[23] = ((w[3] >> 4) & 0x0F0F0F0Fu) | ((w[2] >> 2) & 0x30303030u);
  } else if (type == FC_KQ_Q6_K) {
    const kq_u8* b = row + (kq_u64)u * kq_block_bytes(type);
    for (int i = 0; i < 4; ++i) kq_load_even<2, true>(b + 32 * i + 8 * t, w + 2 * i);  // i = 2 h + a: 64 h + 32 a
    for (int h = 0; h < 2; ++h) kq_load_even<2, true>(b + 128 + 32 * h + 8 * t, w + 8 + 2 * h);
    kq_load_even<4, true>(b + 192, w + 12);
    kq_load_even<1, true>(b + 208, w + 16);
  } else {  // FC_KQ_Q8_0
    for (int m = 0; m < 8; ++m) {
      const kq_u8* b = row + (kq_u64)(u * 8 + m) * kq_block_bytes(type);
      kq_load_even<1, true>(b, w + 3 * m);
      kq_load_even<2, true>(b + 2 + 8 * t, w + 3 * m + 1);
    }
  }
}

// Chunk m (0-7) of the unit, decoded from the thread's words.
FC_KQ_HD void kq_unit_chunk(int type, const KqUnit& r, int m, KqFrag* f) {
  const kq_u32* w = r.w;
  if (type == FC_KQ_Q4_K || type == FC_KQ_Q5_K) {
    // As kq_decode_chunk: sub-block m takes nibble m % 2 of qs[32 (m / 2) + l] (and bit m of qh[l], Q5_K).
    const int nib = (m & 1) * 4, qs = (type == FC_KQ_Q5_K ? 6 : 4) + 2 * (m >> 1), sh = 8 * (m & 3);
    for (int i = 0; i < 2; ++i) {
      f->q[i] = (w[qs + i] >> nib) & 0x0F0F0F0Fu;
      if (type == FC_KQ_Q5_K) f->q[i] |= ((w[4 + i] >> m) & 0x01010101u) << 4;
    }
    f->sc[0] = f->sc[1] = (int)((w[20 + (m >> 2)] >> sh) & 0xFF);
    f->mn = (int)((w[22 + (m >> 2)] >> sh) & 0xFF);
    f->dm = 1.f;
  } else if (type == FC_KQ_Q6_K) {
    // As kq_decode_chunk: value 128 h + 32 g + l from ql[64 h + 32 (g % 2) + l] (nibble g / 2) and qh[32 h + l]
    // (bits 2g), minus 32; scale 8 h + 2 g + l / 16.
    const int h = m >> 2, g = m & 3, nib = (g >> 1) * 4, hs = 2 * g, k = 8 * h + 2 * g;
    for (int i = 0; i < 2; ++i) {
      const kq_u32 ql = w[2 * (2 * h + (g & 1)) + i], qh = w[8 + 2 * h + i];
      f->q[i] = kq_q6_signed(((ql >> nib) & 0x0F0F0F0Fu) | (((qh >> hs) & 0x03030303u) << 4));
    }
    const kq_u32 sw = w[12 + (k >> 2)];  // k even: both halves' scales in one word
    f->sc[0] = (int)(kq_i8)((sw >> (8 * (k & 3))) & 0xFF);
    f->sc[1] = (int)(kq_i8)((sw >> (8 * (k & 3) + 8)) & 0xFF);
    f->mn = 0;
    f->dm = 1.f;
  } else {  // FC_KQ_Q8_0
    f->q[0] = w[3 * m + 1];
    f->q[1] = w[3 * m + 2];
    f->sc[0] = f->sc[1] = 1;
    f->mn = 0;
    f->dm = kq_half(w[3 * m]);
  }
}

// The activations of the mma forms, per vector (cols values): its units in order, each 64 operand words
// (thread t's 16 at 16 t: word j of chunk m at 16 t + 2 m + j, values 8t + 4j .. + 3 of the chunk, as the
// weights' k-ints) and, in a second array, 16 floats per unit (the 8 chunks' scales, then their sums). Each
// thread then reads its unit with 16-byte loads. Written by fc_kq_quantize with mma = 1.
FC_KQ_HD void kq_mma_x_put(int c, const kq_u32 q[8], float d, float s, kq_u32* xq, float* xs) {
  const int u = c >> 3, m = c & 7;
  for (int w = 0; w < 8; ++w) xq[u * 64 + (w >> 1) * 16 + 2 * m + (w & 1)] = q[w];
  xs[u * 16 + m] = d;
  xs[u * 16 + 8 + m] = s;
}

// The activations of one unit in a warp's ring stage, copied there with the unit's weights (kq_mma_tile): for
// each of the pass's 8 vector slots j, its 64 operand words (16 pieces of 16 bytes) and its 16 floats (4
// pieces: scales, then sums). Why in the ring: loaded at the top of each unit, they were a latency the warp
// waited out every unit (ncu, H200: 0.49 instructions issued per cycle and scheduler, DRAM 46 %); copied S - 1
// units ahead, the grouped MoE at 8 tokens went 174 -> 162 us and o_proj 32.5 -> 26.6 (file
// bench/results/2026-12-02-h200x1-s11-kquant-ab-x-ring.json).
// Pieces are placed so that no read or write meets a bank conflict. A 16-byte shared access is served 8 lanes
// at a time (lanes 0-7, 8-15, ...), one wavefront for each 8 that hit 8 distinct 16-byte bank groups. Lanes 8h ..
// 8h + 7 of a kq_xstage_ops read are (g, t) = (2h, 0-3) and (2h + 1, 0-3), reading pieces 4t + i of slots g: the
// operand piece p of slot j sits at 16 ((p & 8) | (p ^ 2 (p / 8) ^ (j % 2)) % 8) in the slot's 256 bytes, so those
// 8 land in 8 groups. The float piece q at 16 (q ^ (j / 2 % 4)) in the slot's 64: the 4 slots a read's 8 lanes
// take sit in distinct groups. With the operand pieces at 16 (p ^ (j % 4)) instead, each 8 lanes met 2-way
// conflicts: ncu counted 37 % of the grouped MoE up kernel's shared wavefronts as excess (2026-12-02 run s12), which
// this count of wavefronts per unit reproduces (and 43 % for the Q5_K down kernel).
#define FC_KQ_MMA_XOPS 2048    // bytes of operand words in a stage: 8 slots x 256
#define FC_KQ_MMA_XSTAGE 2560  // and the slots' floats, 8 x 64
static_assert(FC_KQ_MMA_XSTAGE == FC_KQ_MMA_XOPS + 8 * 64, "a stage's activations: operands, then floats");
FC_KQ_HD int kq_xstage_op(int j, int p) { return 256 * j + 16 * ((p & 8) | ((p ^ ((p >> 3) << 1) ^ (j & 1)) & 7)); }
FC_KQ_HD int kq_xstage_float(int j, int q) { return FC_KQ_MMA_XOPS + 64 * j + 16 * (q ^ ((j >> 1) & 3)); }

// One thread's activations for unit u, read from the stage as its chunks need them: the operand words of slot g
// (chunk m's two at b[2 m ..]), and the scales (and, MINS, sums) of slots 2t and 2t + 1, whose outputs it holds.
struct KqXUnit {
  kq_u32 b[16];
  float d[2][8], s[2][8];
};

FC_KQ_HD void kq_load16f_shared(const kq_u8* p, float f[4]) {  // p 16-byte aligned, in shared memory on the GPU
#if defined(__CUDA_ARCH__)
  const float4 v = *reinterpret_cast<const float4*>(p);
  f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
#else
  memcpy(f, p, 16);
#endif
}

// Chunks 2i and 2i + 1's operand words of slot g (thread t's piece 4t + i: kq_mma_x_put's order).
FC_KQ_HD void kq_xstage_ops(const kq_u8* xst, int g, int t, int i, KqXUnit* x) {
  kq_load16<true>(xst + kq_xstage_op(g, 4 * t + i), x->b + 4 * i);
}

// Half h's (chunks 4h .. 4h + 3) scales (and, MINS, sums) of slots 2t and 2t + 1.
template <bool MINS>
FC_KQ_HD void kq_xstage_scales(const kq_u8* xst, int t, int h, KqXUnit* x) {
  for (int j = 0; j < 2; ++j) {
    kq_load16f_shared(xst + kq_xstage_float(2 * t + j, h), x->d[j] + 4 * h);
    if (MINS) kq_load16f_shared(xst + kq_xstage_float(2 * t + j, 2 + h), x->s[j] + 4 * h);
  }
}

// Chunk m's part of the unit's sums: uacc[j] (rows g, g, g + 8, g + 8 by vectors v0, v1, v0, v1, the mma's C
// layout) from the integer dots r (Q6_K: r of the first half, r2 of the second), umin[j] the mins' part.
FC_KQ_HD void kq_mma_chunk(int type, const KqFrag& fa, const KqFrag& fb, const int r[4], const int r2[4],
                           const KqXUnit& x, int m, float uacc[4], float umin[4]) {
  for (int j = 0; j < 4; ++j) {
    const KqFrag& f = j < 2 ? fa : fb;
    const float dx = x.d[j & 1][m];
    if (type == FC_KQ_Q4_K || type == FC_KQ_Q5_K) {
      uacc[j] += (float)(f.sc[0] * r[j]) * dx;
      umin[j] += (float)f.mn * x.s[j & 1][m];
    } else if (type == FC_KQ_Q6_K) {
      uacc[j] += (float)(f.sc[0] * r[j] + f.sc[1] * r2[j]) * dx;
    } else {
      uacc[j] += (float)r[j] * (f.dm * dx);
    }
  }
}

// The unit's sums into acc, times the rows' super-block scales (d, and dmin for the mins).
FC_KQ_HD void kq_mma_unit_end(int type, const KqUnit& ua, const KqUnit& ub, const float uacc[4],
                              const float umin[4], float acc[4]) {
  for (int j = 0; j < 4; ++j) {
    const kq_u32* w = (j < 2 ? ua : ub).w;
    if (type == FC_KQ_Q4_K || type == FC_KQ_Q5_K) {
      acc[j] += kq_half(w[0]) * uacc[j] - kq_half(w[0] >> 16) * umin[j];
    } else if (type == FC_KQ_Q6_K) {
      acc[j] += kq_half(w[16]) * uacc[j];
    } else {
      acc[j] += uacc[j];
    }
  }
}
