// Pull all-reduce for large messages over NVLink: every rank reads its peers' data directly.
//
// Each rank copies its input into its own P2P-visible buffer (a local copy), tells every peer "block b's
// part is there", then each block reads its part of every peer's buffer over the link and sums locally. Over
// NVLink a remote load costs little more than a local one, so the message crosses each link once as reads,
// with no second hop and only per-block flags as writes to peers. Not for the host transport: host memory
// holds no peer-readable copy of a GPU's buffer (the policy never picks it there).
//
// Two forms:
//  - one-stage (fc_pull): block b owns chunk b of the message; it reads that chunk from all W
//    buffers and writes the sum. Each GPU reads (W-1) x S over its link.
//  - two-stage (fc_pull2): reduce-scatter by pull (rank s sums segment s, reading it from every
//    peer), then all-gather by pull (every rank reads every other reduced segment). 2 (W-1) S / W read per
//    GPU and two flag rounds instead of one.
// Which for W > 2: per GPU, one-stage reads (W-1)(W-2)/W x S more but saves one flag round (a peer write
// plus a poll, ~1-2 us). At W = 2 the reads are equal (S), so one-stage always wins; at W = 8 the one-stage
// reads 4x the bytes, so it only pays while the message is small next to what the link moves during one
// flag round. fastcomm.policy.launch.pull_stages holds the switch point per world size.
//
// Ordering per block and phase (one fence per block per phase, no peer atomics):
//   writer: all threads store into its own buffer -> __syncthreads -> thread 0: fence.acq_rel.sys, then a
//           plain st.relaxed.sys of the epoch into each peer's flag word for (me, phase, block)
//   reader: warp 0, lane s polls source s's flag with ld.acquire.sys; each round re-polls every source
//           still pending (a ballot), the deadline bounds the whole wait -> __syncthreads -> all threads load
// The fence is cumulative over the block's stores (seen through the barrier) and the acquire is shared
// with the block through the second barrier, so no remote load sees the previous call's bytes.
//
// Reuse without a barrier (common.cuh, the two-halves argument): half h = epoch & 1. A peer reads my half
// h (buffer and reduced segment) only inside its call-k kernel. I write half h again in call k+2, after my
// call k+1 finished; every kernel of the group receives from every rank (pull, two-shot, one-shot and fused
// without islands: each reads or waits for every peer), so my call k+1 saw each peer's call-(k+1) data or
// flags, which the peer produced only after its call-k kernel ended. The flag arrays are halved for the
// same reason: a peer one call ahead writes call k+1's epoch into the other half, never over the word I am
// still waiting on; it cannot reach call k+2 (this half) before I finish call k+1. A stale flag holds an
// older epoch, never this one (the 2^32 wrap limit of fc_next_epoch applies).
//
// out may alias in: block b reads in only inside its own part (chunk b, or chunk b of every segment),
// entirely into its buffer before its first __syncthreads, and writes out only there and afterwards; no
// other block touches those bytes. Own terms come from the own buffer, the same path as peers'.
//
// The world size is read at run time: per-source loops unroll to FC_MAX_WORLD with a predicate, and the
// peers' addresses are read from the table once, before any loop (no table load per vector).
//
// Sums run in rank order 0..W-1 in fp32, seeded by rank 0's term, on every rank (bitwise-identical
// results; -0.0 + -0.0 stays -0.0, NaN and inf follow IEEE). Vectors are 16 bytes; the message's last
// vector is zero-padded in the buffers and written back only over its real bytes.
#pragma once
#include "common.cuh"

// Where this thread publishes and polls, read from the table once at the kernel's start (so these loads
// overlap the copy-in instead of adding dependent latencies to each phase): thread 0 holds my flag array
// in every peer, lane s of warp 0 the array where source s's flags land (null: no source).
struct FcPullFlags {
  u32* push[FC_MAX_WORLD];
  u32* pull;
};

__device__ __forceinline__ FcPullFlags fc_pull_flags(const FcTable* t, u32 h) {
  FcPullFlags f;
  const u32 world = t->world, me = t->rank, lane = threadIdx.x;
#pragma unroll
  for (u32 j = 0; j < FC_MAX_WORLD; ++j)
    f.push[j] = (lane == 0 && j < world && j != me) ? t->pull_flag_push[h][j] : nullptr;
  f.pull = (lane < world && lane != me) ? t->pull_flag_pull[h][lane] : nullptr;
  return f;
}

// Flag word of (source's array, phase, this block).
__device__ __forceinline__ u32* fc_pull_flag(u32* arr, u32 phase) { return arr + phase * FC_MAX_BLOCKS + blockIdx.x; }

// Called by every thread after the block's stores into its own buffer (and reduced segment).
__device__ __forceinline__ void fc_pull_publish(const FcPullFlags& f, u32 phase, u32 epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    fc_fence_sys();
#pragma unroll
    for (u32 j = 0; j < FC_MAX_WORLD; ++j)
      if (f.push[j]) fc_st_relaxed_sys(fc_pull_flag(f.push[j], phase), epoch);
  }
}

// Every peer's flag for (phase, this block) == epoch; called by every thread.
__device__ __forceinline__ void fc_pull_wait(const FcTable* t, const FcPullFlags& f, u32 phase, u32 epoch,
                                             u32 step) {
  static_assert(FC_MAX_WORLD <= 32, "one lane per source");
  if (threadIdx.x < 32) {
    const u32 lane = threadIdx.x;
    const u32* w = f.pull ? fc_pull_flag(f.pull, phase) : nullptr;
    bool ready = !w || fc_ld_acquire_sys(w) == epoch;
    u32 pending = __ballot_sync(0xFFFFFFFFu, !ready);
    if (pending) {
      FcDeadline dl(t->timeout_ns);
      do {
        if (!ready) ready = fc_ld_acquire_sys(w) == epoch;
        pending = __ballot_sync(0xFFFFFFFFu, !ready);
        // Every lane counts the same polls; lane 0 reads the clock and names the first stalled source.
        if (pending && dl.expired() && lane == 0) fc_fail(t, __ffs(pending) - 1, step, epoch);
      } while (pending);
    }
  }
  __syncthreads();
}

// The vector at byte `off` of every rank's buffer, summed in rank order 0..world-1; all loads issued first.
template <class D>
__device__ __forceinline__ uint4 fc_pull_sum(const char* const* src, u32 world, u64 off) {
  typedef FcVec<D> V;
  uint4 v[FC_MAX_WORLD];
#pragma unroll
  for (u32 s = 0; s < FC_MAX_WORLD; ++s)
    if (s < world) v[s] = fc_lp_load(src[s] + off);
  float acc[V::N];
#pragma unroll
  for (u32 s = 0; s < FC_MAX_WORLD; ++s) {
    if (s < world) {
      float f[V::N];
      V::unpack(v[s], f);
#pragma unroll
      for (int e = 0; e < V::N; ++e) acc[e] = (s == 0) ? f[e] : acc[e] + f[e];
    }
  }
  return V::pack(acc);
}

// The block's vectors [b0, b1) of `in` into my buffer (same offsets), the tail zero-padded.
__device__ __forceinline__ void fc_pull_stage_in(char* own, const char* in, u64 b0, u64 b1, u64 nbytes) {
  for (u64 i = b0 + threadIdx.x; i < b1; i += blockDim.x)
    *reinterpret_cast<uint4*>(own + i * FC_VEC_BYTES) = fc_load_vec(in, i, nbytes);
}

// chunk: vectors per block (fastcomm.policy.launch.pull_launch).
template <class D>
__device__ __forceinline__ void fc_pull(const FcTable* __restrict__ t, const char* in, char* out, u64 nbytes,
                                        u64 chunk) {
  const u32 epoch = fc_begin(t);
  const u32 h = epoch & 1u;
  const u64 nvec = (nbytes + FC_VEC_BYTES - 1) / FC_VEC_BYTES;
  const u64 b0 = (u64)blockIdx.x * chunk < nvec ? (u64)blockIdx.x * chunk : nvec;
  const u64 b1 = b0 + chunk < nvec ? b0 + chunk : nvec;
  const u32 world = t->world;
  const char* src[FC_MAX_WORLD];
#pragma unroll
  for (u32 s = 0; s < FC_MAX_WORLD; ++s) src[s] = s < world ? t->pull_buf[h][s] : nullptr;
  const FcPullFlags fl = fc_pull_flags(t, h);

  fc_pull_stage_in(t->pull_buf[h][t->rank], in, b0, b1, nbytes);
  fc_pull_publish(fl, 0, epoch);
  fc_pull_wait(t, fl, 0, epoch, FC_STEP_PULL);
  for (u64 i = b0 + threadIdx.x; i < b1; i += blockDim.x)
    fc_store_vec(out, i, nbytes, fc_pull_sum<D>(src, world, i * FC_VEC_BYTES));
  fc_end(t, epoch);
}

// seg: vectors per segment (rank s reduces [s*seg, (s+1)*seg)); chunk: vectors per block inside a segment.
// Block b handles chunk b of every segment.
template <class D>
__device__ __forceinline__ void fc_pull2(const FcTable* __restrict__ t, const char* in, char* out, u64 nbytes,
                                         u64 seg, u64 chunk) {
  const u32 epoch = fc_begin(t);
  const u32 h = epoch & 1u;
  const u32 me = t->rank, world = t->world;
  const u64 nvec = (nbytes + FC_VEC_BYTES - 1) / FC_VEC_BYTES;
  const u64 cb = (u64)blockIdx.x * chunk;  // this block's start inside any segment
  const char* src[FC_MAX_WORLD];
  const char* red[FC_MAX_WORLD];
#pragma unroll
  for (u32 s = 0; s < FC_MAX_WORLD; ++s) {
    src[s] = s < world ? t->pull_buf[h][s] : nullptr;
    red[s] = s < world ? t->pull_red[h][s] : nullptr;
  }
  const FcPullFlags fl = fc_pull_flags(t, h);
  // Vectors of segment s this block covers, relative to the segment's start: [cb, end(s)).
  auto seg_end = [&](u32 s) -> u64 {
    const u64 s0 = (u64)s * seg;
    const u64 len = s0 >= nvec ? 0 : (nvec - s0 < seg ? nvec - s0 : seg);
    const u64 e = cb + chunk < len ? cb + chunk : len;
    return e > cb ? e : cb;
  };

  // 1. My chunk b of every segment into my buffer; then everyone may read it.
  char* own = t->pull_buf[h][me];
  for (u32 s = 0; s < world; ++s) fc_pull_stage_in(own, in, (u64)s * seg + cb, (u64)s * seg + seg_end(s), nbytes);
  fc_pull_publish(fl, 0, epoch);
  fc_pull_wait(t, fl, 0, epoch, FC_STEP_PULL);

  // 2. Reduce-scatter by pull: my segment's chunk from every buffer, into my reduced segment and out.
  char* mine = t->pull_red[h][me];
  const u64 base = (u64)me * seg, my_end = seg_end(me);
  for (u64 k = cb + threadIdx.x; k < my_end; k += blockDim.x) {
    const uint4 r = fc_pull_sum<D>(src, world, (base + k) * FC_VEC_BYTES);
    *reinterpret_cast<uint4*>(mine + k * FC_VEC_BYTES) = r;
    fc_store_vec(out, base + k, nbytes, r);
  }
  fc_pull_publish(fl, 1, epoch);
  fc_pull_wait(t, fl, 1, epoch, FC_STEP_PULL_AG);

  // 3. All-gather by pull: chunk b of every other reduced segment, all loads issued before the stores.
  u64 end[FC_MAX_WORLD];
  u64 last = cb;
#pragma unroll
  for (u32 s = 0; s < FC_MAX_WORLD; ++s) {
    end[s] = s < world ? seg_end(s) : cb;
    if (s != me && end[s] > last) last = end[s];
  }
  for (u64 k = cb + threadIdx.x; k < last; k += blockDim.x) {
    uint4 v[FC_MAX_WORLD];
#pragma unroll
    for (u32 s = 0; s < FC_MAX_WORLD; ++s)
      if (s != me && k < end[s]) v[s] = fc_lp_load(red[s] + k * FC_VEC_BYTES);
#pragma unroll
    for (u32 s = 0; s < FC_MAX_WORLD; ++s)
      if (s != me && k < end[s]) fc_store_vec(out, (u64)s * seg + k, nbytes, v[s]);
  }
  fc_end(t, epoch);
}
