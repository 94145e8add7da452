// Two-shot all-reduce (reduce-scatter, then all-gather) for medium and large messages.
//
// The message is cut into `world` segments; rank s reduces segment s. Each segment is cut into gridDim.x
// chunks, and block b handles chunk b of every segment, so a block only ever waits for the same block of
// its peers. Data moves as plain 16-byte stores; readiness is a per-(source, block) flag written after the
// block's stores (full bandwidth, one flag per chunk instead of per packet).
//
// The body is a template on the world size W (2..8, one switch on t->world at entry): every per-peer loop
// unrolls, the peer pointers of a phase sit in registers (loaded from the table once, up front, not one
// dependent table load per peer per vector), and every peer load of a vector is in flight before any is
// used.
//
// Ordering per chunk, per phase (one system-scope fence per block per phase, not one release per peer):
//   writer: all threads store data -> __syncthreads -> thread 0: fence.acq_rel.sys, then st.relaxed.sys
//           flag = epoch to every destination
//   reader: one thread per source: ld.acquire.sys flag == epoch -> __syncthreads -> all threads read data
// Why that is enough (PTX memory model): the barrier makes every thread's data stores happen before thread
// 0's fence; a fence followed by a strong store is a release pattern, cumulative over everything that
// happens before the fence, so each flag store releases the whole block's data, to every destination, with
// one fence. The reader's ld.acquire.sys that sees the flag synchronizes with that pattern, and its
// barrier extends the order to every reader thread, so no data load can see the previous call's bytes.
#pragma once
#include "common.cuh"

// Elements of block b's chunk inside segment s: segments and chunks are whole 16-byte vectors, so only the
// segment holding the message's end can be short (or empty, for small messages), and only it can end in a
// partial vector.
__device__ __forceinline__ u64 fc_chunk_count(u64 n, u64 seg, u64 chunk, u32 s) {
  const u64 seg_begin = (u64)s * seg;
  const u64 seg_len = n > seg_begin ? (n - seg_begin < seg ? n - seg_begin : seg) : 0;
  const u64 base = (u64)blockIdx.x * chunk;
  if (seg_len <= base) return 0;
  return seg_len - base < chunk ? seg_len - base : chunk;
}

// One thread per source waits for that source's flag of this block; the barrier then shares the acquire.
// The sources' threads spin at the same time, so the waits overlap.
__device__ __forceinline__ void fc_wait_all(const FcTable* t, u32* const* flags, u32 epoch, u32 step) {
  const u32 src = threadIdx.x;
  if (src < t->world && src != t->rank) fc_wait_flag(t, flags[src] + blockIdx.x, epoch, src, step);
  __syncthreads();
}

// The two-shot's data steps, one template each, shared with the island two-shot (two_shot_islands.cuh), which
// runs them on its island's and its partners' tables. cnt[s]: elements of this block's chunk in segment s of
// S; base: the block's element offset inside every segment; h: the buffer half of this call.

// Scatter: my copy of this block's chunk of every other segment goes to that segment's owner, then one fence
// for the block and relaxed flag stores.
template <class D, u32 S>
__device__ __forceinline__ void fc_ts_scatter(const FcTable* __restrict__ t, u32 h, u32 me, const char* in, u64 seg,
                                              u64 base, const u64 (&cnt)[S], u32 epoch) {
  typedef typename D::raw R;
  constexpr u32 PV = 16 / sizeof(R);
  const u32 tid = threadIdx.x, nthr = blockDim.x;
  char* dst[S];
  u32* flag[S];
#pragma unroll
  for (u32 s = 0; s < S; ++s) {
    dst[s] = t->rs_push[h][s] + base * sizeof(R);
    flag[s] = t->rs_flag_push[h][s] + blockIdx.x;
  }
  const u64 nv = cnt[0] / PV;  // the most whole vectors any segment's chunk has
  for (u64 v = tid; v < nv; v += nthr) {
    uint4 x[S];
#pragma unroll
    for (u32 s = 0; s < S; ++s)
      if (s != me && v < cnt[s] / PV)
        x[s] = *reinterpret_cast<const uint4*>(in + ((u64)s * seg + base + v * PV) * sizeof(R));
#pragma unroll
    for (u32 s = 0; s < S; ++s)
      if (s != me && v < cnt[s] / PV) *reinterpret_cast<uint4*>(dst[s] + v * 16) = x[s];
  }
#pragma unroll
  for (u32 s = 0; s < S; ++s) {  // the message tail: at most PV-1 elements, in one segment
    if (s == me) continue;
    for (u64 e = cnt[s] / PV * PV + tid; e < cnt[s]; e += nthr)
      *reinterpret_cast<R*>(dst[s] + e * sizeof(R)) =
          *reinterpret_cast<const R*>(in + ((u64)s * seg + base + e) * sizeof(R));
  }
  __syncthreads();
  if (tid == 0) {
    fc_fence_sys();
#pragma unroll
    for (u32 s = 0; s < S; ++s)
      if (s != me) fc_st_relaxed_sys(flag[s], epoch);
  }
}

// The all-gather destinations of table t's half h for the chunk at element `base`: its first n_ag_push
// slots (peers over P2P, or my one host slot) and their flags for this block; the rest of the K null.
// Returns n_ag_push.
template <class R, u32 K>
__device__ __forceinline__ u32 fc_ts_ag_dests(const FcTable* __restrict__ t, u32 h, u64 base, char* (&dst)[K],
                                              u32* (&flag)[K]) {
  const u32 n = t->n_ag_push;
#pragma unroll
  for (u32 j = 0; j < K; ++j) {
    dst[j] = j < n ? t->ag_push[h][j] + base * sizeof(R) : nullptr;
    flag[j] = j < n ? t->ag_flag_push[h][j] + blockIdx.x : nullptr;
  }
  return n;
}

// The sources of a reduce step for the chunk at element `base`: my own term (`mine`, at `me`) and every
// other source's as it landed in my `pull` slots (a table's rs_pull[h] or ag_pull[h]).
template <class R, u32 N>
__device__ __forceinline__ void fc_ts_sources(char* const* pull, u32 me, const char* mine, u64 base,
                                              const char* (&src)[N]) {
#pragma unroll
  for (u32 p = 0; p < N; ++p) src[p] = (p == me) ? mine : pull[p] + base * sizeof(R);
}

// Reduce and push: sum N sources in source order (src[mine] is this rank's own, read as plain
// memory; the others fresh from the system), round to D, write the result to dout and to the first ndst of
// K push destinations, then publish them: one fence for the block, then relaxed flag stores.
template <class D, u32 N, u32 K>
__device__ __forceinline__ void fc_ts_reduce_push(const char* const (&src)[N], u32 mine, u64 count, char* dout,
                                                   char* const (&dst)[K], u32* const (&flag)[K], u32 ndst,
                                                   u32 epoch) {
  typedef typename D::raw R;
  constexpr u32 PV = 16 / sizeof(R);
  const u32 tid = threadIdx.x, nthr = blockDim.x;
  const u64 nv = count / PV;
  for (u64 v = tid; v < nv; v += nthr) {
    uint4 x[N];
#pragma unroll
    for (u32 p = 0; p < N; ++p)  // every load first, then the sums
      x[p] = (p == mine) ? *reinterpret_cast<const uint4*>(src[p] + v * 16) : fc_load_cv16(src[p] + v * 16);
    float acc[PV];
#pragma unroll
    for (u32 p = 0; p < N; ++p) {
      float f[PV];
      FcVec<D>::unpack(x[p], f);
#pragma unroll
      for (u32 e = 0; e < PV; ++e) acc[e] = (p == 0) ? f[e] : acc[e] + f[e];
    }
    const uint4 r = FcVec<D>::pack(acc);
    *reinterpret_cast<uint4*>(dout + v * 16) = r;
#pragma unroll
    for (u32 j = 0; j < K; ++j)
      if (j < ndst) *reinterpret_cast<uint4*>(dst[j] + v * 16) = r;
  }
  for (u64 e = nv * PV + tid; e < count; e += nthr) {  // the message tail, element by element
    R x[N];
#pragma unroll
    for (u32 p = 0; p < N; ++p)
      x[p] = (p == mine) ? *reinterpret_cast<const R*>(src[p] + e * sizeof(R))
                         : *reinterpret_cast<const volatile R*>(src[p] + e * sizeof(R));
    float acc = 0.f;
#pragma unroll
    for (u32 p = 0; p < N; ++p) acc = (p == 0) ? D::to_f(x[p]) : acc + D::to_f(x[p]);
    const R r = D::from_f(acc);
    *reinterpret_cast<R*>(dout + e * sizeof(R)) = r;
#pragma unroll
    for (u32 j = 0; j < K; ++j)
      if (j < ndst) *reinterpret_cast<R*>(dst[j] + e * sizeof(R)) = r;
  }
  __syncthreads();
  if (tid == 0) {
    fc_fence_sys();
#pragma unroll
    for (u32 j = 0; j < K; ++j)
      if (j < ndst) fc_st_relaxed_sys(flag[j], epoch);
  }
}

// Gather: every other segment's finished chunk from the owners' pushes into out, all sources' loads in
// flight together (the caller has waited for their flags).
template <class D, u32 S>
__device__ __forceinline__ void fc_ts_gather(const FcTable* __restrict__ t, u32 h, u32 me, char* out, u64 seg,
                                             u64 base, const u64 (&cnt)[S]) {
  typedef typename D::raw R;
  constexpr u32 PV = 16 / sizeof(R);
  const u32 tid = threadIdx.x, nthr = blockDim.x;
  const char* src[S];
#pragma unroll
  for (u32 p = 0; p < S; ++p) src[p] = t->ag_pull[h][p] + base * sizeof(R);
  const u64 nv = cnt[0] / PV;
  for (u64 v = tid; v < nv; v += nthr) {
    uint4 x[S];
#pragma unroll
    for (u32 p = 0; p < S; ++p)
      if (p != me && v < cnt[p] / PV) x[p] = fc_load_cv16(src[p] + v * 16);
#pragma unroll
    for (u32 p = 0; p < S; ++p)
      if (p != me && v < cnt[p] / PV)
        *reinterpret_cast<uint4*>(out + ((u64)p * seg + base + v * PV) * sizeof(R)) = x[p];
  }
#pragma unroll
  for (u32 p = 0; p < S; ++p) {
    if (p == me) continue;
    for (u64 e = cnt[p] / PV * PV + tid; e < cnt[p]; e += nthr)
      *reinterpret_cast<R*>(out + ((u64)p * seg + base + e) * sizeof(R)) =
          *reinterpret_cast<const volatile R*>(src[p] + e * sizeof(R));
  }
}

template <class D, u32 W>
__device__ __forceinline__ void fc_two_shot_w(const FcTable* __restrict__ t, const char* in, char* out, u64 n,
                                              u64 seg, u64 chunk) {
  typedef typename D::raw R;
  const u32 epoch = fc_begin(t);
  const u32 h = epoch & 1u;
  const u32 me = t->rank;
  const u64 base = (u64)blockIdx.x * chunk;  // this block's element offset inside every segment

  u64 cnt[W];  // elements of my chunk in segment s; non-increasing in s
#pragma unroll
  for (u32 s = 0; s < W; ++s) cnt[s] = fc_chunk_count(n, seg, chunk, s);

  // 1. Reduce-scatter, send: my copy of chunk b of every other segment goes to that segment's owner.
  fc_ts_scatter<D, W>(t, h, me, in, seg, base, cnt, epoch);

  // 2. Reduce my segment's chunk in rank order (identical on every rank), then push the result out.
  fc_wait_all(t, t->rs_flag_pull[h], epoch, FC_STEP_RS);
  {
    const char* src[W];
    fc_ts_sources<R>(t->rs_pull[h], me, in + ((u64)me * seg + base) * sizeof(R), base, src);
    char* agd[W - 1];
    u32* agf[W - 1];
    const u32 nag = fc_ts_ag_dests<R>(t, h, base, agd, agf);  // W-1 peers (P2P) or my one host slot
    char* dout = out + ((u64)me * seg + base) * sizeof(R);
    const u64 count = fc_chunk_count(n, seg, chunk, me);  // not cnt[me]: a runtime index spills cnt[]
    fc_ts_reduce_push<D, W, W - 1>(src, me, count, dout, agd, agf, nag, epoch);
  }

  // 3. All-gather, receive: every other segment's reduced chunk b, all sources' loads in flight together.
  fc_wait_all(t, t->ag_flag_pull[h], epoch, FC_STEP_AG);
  fc_ts_gather<D, W>(t, h, me, out, seg, base, cnt);
  fc_end(t, epoch);
}

// One entry point per dtype (kernels.cu), the world size picked here: t->world is fixed for the
// workspace's life, so the branch is uniform and the host keeps one kernel name and one launch path.
template <class D>
__device__ __forceinline__ void fc_two_shot(const FcTable* __restrict__ t, const char* in, char* out, u64 n,
                                            u64 seg, u64 chunk) {
  switch (t->world) {
    case 2: fc_two_shot_w<D, 2>(t, in, out, n, seg, chunk); break;
    case 3: fc_two_shot_w<D, 3>(t, in, out, n, seg, chunk); break;
    case 4: fc_two_shot_w<D, 4>(t, in, out, n, seg, chunk); break;
    case 5: fc_two_shot_w<D, 5>(t, in, out, n, seg, chunk); break;
    case 6: fc_two_shot_w<D, 6>(t, in, out, n, seg, chunk); break;
    case 7: fc_two_shot_w<D, 7>(t, in, out, n, seg, chunk); break;
    case 8: fc_two_shot_w<D, 8>(t, in, out, n, seg, chunk); break;
    default: __trap();  // the plan admits 2..FC_MAX_WORLD ranks only
  }
}
