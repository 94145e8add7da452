// Fused all-reduce + residual add + RMSNorm, two-shot shaped: reduce-scatter, all-gather, then the norm
// where the data lands. For the token counts (about 2-64 at 4-8 ranks) where the one-shot fused op's W-1
// copies of the message per GPU are too many bytes: here each GPU sends about 2 (W-1)/W of the message.
//
// Rounding contract: the same as fused_rmsnorm.cuh (a = D(sum in rank order), z = a + residual in fp32,
// residual_out = D(z), variance over the unrounded z, out = D(z * inv_rms * weight)). What travels in the
// all-gather is a = D(sum), not D(z): z cannot be rebuilt from D(z) (the variance and out need the unrounded
// z), and the fp32 z would double the bytes for bf16/fp16. a costs the payload's bytes and every rank
// rebuilds z = a + residual exactly as the unfused path does. So, as in the one-shot fused op, every rank
// adds its own residual: the outputs agree bit for bit across ranks when the residuals do (vLLM's are
// replicated); a, the all-reduce, agrees always.
//
// The cut: every row is cut by hidden columns into W parts of `cols` elements (a multiple of 16 bytes; the
// last part shorter; every part non-empty, checked on the host); rank p owns part p of every row. Why
// columns and not rows: at 2-64 tokens and 4-8 ranks whole rows leave owners idle (1 or 2 tokens) or
// uneven (17 tokens at 8 ranks: 3 rows against 2, the busiest rank sends 1.4x the mean), and a row is a
// unit of the norm that no owner would then share; column parts are balanced to 16 bytes per row and
// start at a 16-byte offset inside their row, so when rows are 16-byte aligned (hidden x size % 16 == 0,
// as 6144, 7168 and 1000 bf16 are) every load and store is one vector; other rows go element by element.
//
// Readiness: the Lamport slots (common.cuh, "Lamport one-shot"), not flags: no flag round trip per phase,
// and this kernel shares the one-shot's buffers, rotation and clears (state[2..3]). Vector k of part p of
// row r is item i = r * pv + k (pv = cols / 16-byte vector). Per slot of buffer b:
//   P2P:  lp_pull[b][s] = [s's copy of my part: tp vectors][s's reduced part (all-gather): tp vectors]
//   host: rank s's slot = [s's copy of part 0..W-1: W x tp vectors (its own part unused)][s's reduced part]
// (tp = tokens x pv). The clear rules of common.cuh hold for this kernel as they are written: every slot
// it writes lies within the bytes it records in state[3] (2 tp or (W+1) tp vectors), and it receives from
// every rank it sends to, before its kernel ends: every rank's part is non-empty, so an owner waits for
// every peer's copy of its part (reduce-scatter) and every rank waits for every owner's part (all-gather,
// read by every block over a whole row). Host: a block clears its share of its own slot only after its
// row's all-gather reads, which have seen call-c data from every peer (a block with no row waits for item
// 0 of every peer's all-gather instead: item 0 of the reduce-scatter area is not written by every rank).
//
// Order and waits. Phase 1 (thread per item, grid-strided): push my copy of item i of every part to its
// owner, then, for my own part, sum every rank's copy in rank order (fc_lp_gather_sum: all sources polled
// each round), round and push a to every rank. Phase 2 (block per (row, split)): wait for the row's a from
// every owner (all of a thread's positions polled each round), sum of squares, outputs. The same item
// index maps to the same thread on every rank and each thread pushes before it waits, so phase 1 cannot
// close a cycle; phase 2 waits only on phase 1, which never waits on phase 2, but on another block of the
// same rank, so every block must be resident at once (grid <= SM count, one block of <= 1024 threads per
// SM, as for the fused op).
//
// Sum of squares in a fixed order: thread t takes positions t, t + blockDim, ... of the row (position
// p * pv + k), then fc_block_sum; it depends on the row and blockDim only, so every block of a row and
// every rank get the same bits. A row is split into `splits` output chunks (one block each) so one token
// still uses several SMs; each block reads the whole row, writes only its chunk.
//
// Aliasing (out may be x, residual_out may be residual): x element e is read once, in phase 1, and the
// output at e is written only after a at e arrived, which depends on that read (through the owner). The
// residual is read over the whole row by every block of the row, so when an output overlaps the residual
// the host sets splits = 1 (its one block reads the row before any write: fc_block_sum's barrier).
#pragma once
#include "common.cuh"
#include "fused_rmsnorm.cuh"

#define FC_FTS_K 4  // positions of a row per thread in phase 2 (held in registers between the two passes)

// A row position (part p, vector k): its first column and element count (0: past the row's end).
struct FcFtsPos {
  u64 col;
  u32 n;
};

template <class D>
__device__ __forceinline__ FcFtsPos fc_fts_pos(u32 pos, u32 pv, u32 cols, u32 hidden) {
  const u32 p = pos / pv, k = pos % pv;
  const u64 col = (u64)p * cols + (u64)k * FcVec<D>::N;
  const u32 n = col < hidden ? ((u64)hidden - col < (u64)FcVec<D>::N ? (u32)(hidden - col) : (u32)FcVec<D>::N) : 0u;
  return FcFtsPos{col, n};
}

template <class D>
__device__ __forceinline__ void fc_fused_two_shot(const FcTable* __restrict__ t, const char* in, const char* residual,
                                                  const char* __restrict__ weight, char* out, char* residual_out,
                                                  u32 tokens, u32 hidden, u32 cols, u32 splits, float eps) {
  typedef FcVec<D> V;
  typedef typename D::raw R;
  __shared__ float smem32[32];

  const FcLpCall c = fc_lp_begin(t);
  const u32 world = t->world, me = t->rank;
  const u32 pv = cols / V::N;
  const u64 tp = (u64)tokens * pv;
  const u64 rs_off = t->host ? (u64)me * tp * FC_VEC_BYTES : 0;  // my part in every source's slot
  const u64 ag_off = (t->host ? (u64)world : 1ull) * tp * FC_VEC_BYTES;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

  fc_lp_clear_received(t, c);

  // 1. Reduce-scatter, then my part's sum goes out to everyone (and, P2P, into my own slot for my blocks).
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < tp; i += (u64)gridDim.x * blockDim.x) {
    const u64 row = i / pv;
    const u32 k = (u32)(i % pv);
    uint4 mine = zero;
    bool own = false;
    for (u32 p = 0, j = 0; p < world; ++p) {
      const FcFtsPos q = fc_fts_pos<D>(p * pv + k, pv, cols, hidden);
      if (q.n) {
        const uint4 v = fc_lp_sanitize<D>(fc_load_vec(in + (row * hidden + q.col) * sizeof(R), 0, q.n * sizeof(R)));
        if (p == me) {
          mine = v;
          own = true;
        } else if (t->host) {
          fc_lp_store(t->lp_push[c.buf][0] + ((u64)p * tp + i) * FC_VEC_BYTES, v);
        } else {
          fc_lp_store(t->lp_push[c.buf][j] + i * FC_VEC_BYTES, v);
        }
      }
      if (p != me) ++j;  // P2P: lp_push[b][j] is the j-th peer, me skipped
    }
    if (own) {
      float acc[V::N];
      fc_lp_gather_sum<D>(t, c.buf, rs_off + i * FC_VEC_BYTES, mine, FC_STEP_FUSED_RS, c.epoch, acc);
      const uint4 a = fc_lp_sanitize<D>(V::pack(acc));  // a = D(sum); the sentinel pattern goes as NaN
      const u64 o = ag_off + i * FC_VEC_BYTES;
      for (u32 j = 0; j < t->n_lp_push; ++j) fc_lp_store(t->lp_push[c.buf][j] + o, a);
      if (!t->host) fc_lp_store(t->lp_pull[c.buf][me] + o, a);
    }
  }

  // 2. Rows: all-gather, norm, outputs.
  const u32 npos = world * pv;
  const u32 chunk = (npos + splits - 1) / splits;
  const u32 items = tokens * splits;
  bool gathered = false;
  for (u32 item = blockIdx.x; item < items; item += gridDim.x) {
    const u64 row = item / splits;
    const u32 c0 = (item % splits) * chunk;
    const u32 c1 = c0 + chunk < npos ? c0 + chunk : npos;
    uint4 av[FC_FTS_K];
    u32 pending = 0;
#pragma unroll
    for (int q = 0; q < FC_FTS_K; ++q) {
      const u32 pos = threadIdx.x + q * blockDim.x;
      av[q] = zero;
      if (pos < npos && fc_fts_pos<D>(pos, pv, cols, hidden).n) {
        av[q] = fc_lp_load(t->lp_pull[c.buf][pos / pv] + ag_off + (row * pv + pos % pv) * FC_VEC_BYTES);
        if (!fc_lp_arrived<D>(av[q])) pending |= 1u << q;
      }
    }
    if (pending) {
      FcDeadline dl(t->timeout_ns);
      do {
        if (dl.expired()) fc_fail(t, (threadIdx.x + (__ffs(pending) - 1) * blockDim.x) / pv, FC_STEP_FUSED_AG, c.epoch);
#pragma unroll
        for (int q = 0; q < FC_FTS_K; ++q) {
          if (pending & (1u << q)) {
            const u32 pos = threadIdx.x + q * blockDim.x;
            av[q] = fc_lp_load(t->lp_pull[c.buf][pos / pv] + ag_off + (row * pv + pos % pv) * FC_VEC_BYTES);
            if (fc_lp_arrived<D>(av[q])) pending &= ~(1u << q);
          }
        }
      } while (pending);
    }
    gathered = true;  // after fc_block_sum's barrier, the block has seen every owner's part of the row

    float ss = 0.f;
#pragma unroll
    for (int q = 0; q < FC_FTS_K; ++q) {
      const FcFtsPos p = fc_fts_pos<D>(threadIdx.x + q * blockDim.x, pv, cols, hidden);
      if (threadIdx.x + q * blockDim.x < npos && p.n) {
        float a[V::N];
        V::unpack(av[q], a);
        const uint4 rv = residual ? fc_load_vec(residual + (row * hidden + p.col) * sizeof(R), 0, p.n * sizeof(R)) : zero;
        const R* rr = reinterpret_cast<const R*>(&rv);
#pragma unroll
        for (int e = 0; e < V::N; ++e) {
          if ((u32)e < p.n) {
            const float z = residual ? a[e] + D::to_f(rr[e]) : a[e];  // no "+ 0" without a residual: -0 stays -0
            ss += z * z;
          }
        }
      }
    }
    ss = fc_block_sum(ss, smem32);
    const float inv = rsqrtf(ss / (float)hidden + eps);

#pragma unroll
    for (int q = 0; q < FC_FTS_K; ++q) {
      const u32 pos = threadIdx.x + q * blockDim.x;
      const FcFtsPos p = fc_fts_pos<D>(pos, pv, cols, hidden);
      if (pos >= c0 && pos < c1 && p.n) {
        float a[V::N];
        V::unpack(av[q], a);
        const u64 base = (row * hidden + p.col) * sizeof(R);
        const u64 nb = p.n * sizeof(R);
        const uint4 rv = residual ? fc_load_vec(residual + base, 0, nb) : zero;
        const uint4 wv = fc_load_vec(weight + p.col * sizeof(R), 0, nb);
        const R* rr = reinterpret_cast<const R*>(&rv);
        const R* wr = reinterpret_cast<const R*>(&wv);
        uint4 zv, ov;
        R* zr = reinterpret_cast<R*>(&zv);
        R* orr = reinterpret_cast<R*>(&ov);
#pragma unroll
        for (int e = 0; e < V::N; ++e) {
          const float z = residual ? a[e] + D::to_f(rr[e]) : a[e];  // the z of the sum of squares
          zr[e] = D::from_f(z);                                      // residual_out = D(z)
          orr[e] = D::from_f(z * inv * D::to_f(wr[e]));
        }
        if (residual_out) fc_store_vec(residual_out + base, 0, nb, zv);
        fc_store_vec(out + base, 0, nb, ov);
      }
    }
    __syncthreads();  // smem32 is reused by the next item
  }

  // Host: clear my own slot of the previous buffer once every peer's call-c data was seen (see above); a
  // block with no row waits for item 0 of every peer's part (ag_off: every part is non-empty).
  fc_lp_clear_own_after_gather<D>(t, c, gathered, FC_STEP_FUSED_AG, ag_off);
  fc_lp_end(t, c, (u32)(ag_off + tp * FC_VEC_BYTES));
}
