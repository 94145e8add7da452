// Two-shot all-reduce (reduce-scatter, then all-gather) for medium and large messages.
//
// The message is cut into `world` segments; rank s reduces segment s. Each segment is cut into gridDim.x
// chunks, and block b handles chunk b of every segment, so a block only ever waits for the same block of
// its peers. Data moves as plain 16-byte stores; readiness is a per-(source, block) flag written with
// release semantics after the block's stores (full bandwidth, one flag per chunk instead of per packet).
//
// Ordering per chunk, per phase:
//   writer: all threads store data -> __syncthreads -> thread 0: st.release.sys flag = epoch
//   reader: one thread per source: ld.acquire.sys flag == epoch -> __syncthreads -> all threads read data
// The release is cumulative over the block's stores (observed through the barrier), and the acquire is
// shared with the block through the second barrier, so no data load can see the previous call's bytes.
#pragma once
#include "common.cuh"

struct FcChunk {
  u64 begin;  // element range of this block's chunk inside segment s
  u64 end;
};

// Segment and chunk sizes are multiples of 16 bytes so every chunk starts 16-byte aligned.
__device__ __forceinline__ FcChunk fc_chunk(u64 n, u64 seg, u64 chunk, u32 s) {
  u64 seg_begin = (u64)s * seg;
  u64 seg_end = seg_begin + seg < n ? seg_begin + seg : n;
  u64 b = seg_begin + (u64)blockIdx.x * chunk;
  u64 e = b + chunk;
  if (e > seg_end) e = seg_end;
  if (b > e) b = e;
  return FcChunk{b, e};
}

// Copy the chunk's (c.end - c.begin) elements from `src` to `dst` (both already offset to the chunk's start):
// 16 bytes at a time, then the message tail element by element. `volatile_src`: bytes a peer wrote.
template <class D>
__device__ __forceinline__ void fc_copy_chunk(char* dst, const char* src, FcChunk c, bool volatile_src) {
  typedef typename D::raw R;
  const u64 nb = (c.end - c.begin) * sizeof(R);
  const u64 nvec = nb / 16;
  for (u64 v = threadIdx.x; v < nvec; v += blockDim.x) {
    uint4 x = volatile_src ? fc_load_cv16(src + v * 16) : *reinterpret_cast<const uint4*>(src + v * 16);
    *reinterpret_cast<uint4*>(dst + v * 16) = x;
  }
  for (u64 b = nvec * 16 + threadIdx.x * sizeof(R); b < nb; b += (u64)blockDim.x * sizeof(R)) {
    R x = volatile_src ? *reinterpret_cast<const volatile R*>(src + b) : *reinterpret_cast<const R*>(src + b);
    *reinterpret_cast<R*>(dst + b) = x;
  }
}

// One thread per source waits for that source's flag of this block; the barrier then shares the acquire.
__device__ __forceinline__ void fc_wait_all(const FcTable* t, u32* const* flags, u32 epoch, u32 step) {
  const u32 src = threadIdx.x;
  if (src < t->world && src != t->rank) fc_wait_flag(t, flags[src] + blockIdx.x, epoch, src, step);
  __syncthreads();
}

template <class D>
__device__ __forceinline__ void fc_two_shot(const FcTable* __restrict__ t, const char* in,
                                            char* out, u64 n, u64 seg, u64 chunk) {
  typedef typename D::raw R;
  const u32 epoch = fc_begin(t);
  const u32 h = epoch & 1u;
  const u32 world = t->world;
  const u32 me = t->rank;

  // 1. Reduce-scatter, send: my copy of chunk b of every other segment goes to that segment's owner.
  for (u32 s = 0; s < world; ++s) {
    if (s == me) continue;
    FcChunk c = fc_chunk(n, seg, chunk, s);
    fc_copy_chunk<D>(t->rs_push[h][s] + (c.begin - (u64)s * seg) * sizeof(R), in + c.begin * sizeof(R), c, false);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (u32 s = 0; s < world; ++s)
      if (s != me) fc_st_release_sys(t->rs_flag_push[h][s] + blockIdx.x, epoch);
  }

  // 2. Reduce my segment's chunk in rank order (identical on every rank), then push the result out.
  fc_wait_all(t, t->rs_flag_pull[h], epoch, FC_STEP_RS);
  FcChunk mine = fc_chunk(n, seg, chunk, me);
  const u64 off = (mine.begin - (u64)me * seg) * sizeof(R);
  const u64 count = mine.end - mine.begin;
  const u32 nag = t->n_ag_push;
  // 16 bytes at a time where whole; the message tail (last segment only) element by element.
  const u32 per_vec = 16 / sizeof(R);
  const u64 nvec = count / per_vec;
  for (u64 v = threadIdx.x; v < nvec + (count - nvec * per_vec); v += blockDim.x) {
    const bool whole = v < nvec;
    const u64 e0 = whole ? v * per_vec : nvec * per_vec + (v - nvec);
    const u32 ne = whole ? per_vec : 1;
    float acc[16 / sizeof(R)];
    for (u32 p = 0; p < world; ++p) {
      R raw[16 / sizeof(R)];
      const char* src = (p == me) ? in + mine.begin * sizeof(R) : t->rs_pull[h][p] + off;
      if (whole) {
        uint4 x = (p == me) ? *reinterpret_cast<const uint4*>(src + e0 * sizeof(R)) : fc_load_cv16(src + e0 * sizeof(R));
        *reinterpret_cast<uint4*>(raw) = x;
      } else {
        raw[0] = (p == me) ? *reinterpret_cast<const R*>(src + e0 * sizeof(R))
                           : *reinterpret_cast<const volatile R*>(src + e0 * sizeof(R));
      }
      for (u32 e = 0; e < ne; ++e) {
        float f = D::to_f(raw[e]);
        acc[e] = (p == 0) ? f : acc[e] + f;
      }
    }
    R res[16 / sizeof(R)];
    for (u32 e = 0; e < ne; ++e) res[e] = D::from_f(acc[e]);
    const u64 ob = (mine.begin + e0) * sizeof(R);
    if (whole) {
      const uint4 x = *reinterpret_cast<uint4*>(res);
      *reinterpret_cast<uint4*>(out + ob) = x;
      for (u32 j = 0; j < nag; ++j) *reinterpret_cast<uint4*>(t->ag_push[h][j] + off + e0 * sizeof(R)) = x;
    } else {
      *reinterpret_cast<R*>(out + ob) = res[0];
      for (u32 j = 0; j < nag; ++j) *reinterpret_cast<R*>(t->ag_push[h][j] + off + e0 * sizeof(R)) = res[0];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (u32 j = 0; j < nag; ++j) fc_st_release_sys(t->ag_flag_push[h][j] + blockIdx.x, epoch);
  }

  // 3. All-gather, receive: every other segment's reduced chunk b.
  fc_wait_all(t, t->ag_flag_pull[h], epoch, FC_STEP_AG);
  for (u32 p = 0; p < world; ++p) {
    if (p == me) continue;
    FcChunk c = fc_chunk(n, seg, chunk, p);
    fc_copy_chunk<D>(out + c.begin * sizeof(R), t->ag_pull[h][p] + (c.begin - (u64)p * seg) * sizeof(R), c, true);
  }
  fc_end(t, epoch);
}
