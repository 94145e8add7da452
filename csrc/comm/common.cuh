// Device primitives shared by every fastcomm kernel: sizes, the peer table, flag loads/stores at system
// scope, readiness-in-data (sentinel) slots, dtype conversions, bounded waits and the per-launch epoch.
//
// No CUDA headers are included, so the same text compiles under NVRTC (at first use, and in CI for
// sm_80/90/120) and under nvcc.
// No peer atomics anywhere: many PCIe topologies do not carry them. Peers only ever receive plain stores.
#pragma once

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

// Everything the host shares with these kernels is mirrored in fastcomm/abi.py (constants, structs, step and
// group ids, kernel signatures); tests/test_abi.py checks the two against each other.
#define FC_MAX_WORLD 8
#define FC_MAX_BLOCKS 128
#define FC_PACKET_BYTES 16
#define FC_PACKET_PAYLOAD 8
#define FC_VEC_BYTES 16
#define FC_LP_BUFFERS 3

static_assert(FC_PACKET_BYTES == 2 * FC_PACKET_PAYLOAD, "a packet is (4B data, 4B flag) x 2");

// Steps named in timeout errors.
#define FC_STEP_ONE_SHOT 1
#define FC_STEP_RS 2
#define FC_STEP_AG 3
#define FC_STEP_FUSED 4
#define FC_STEP_PULL 5
#define FC_STEP_PULL_AG 6
#define FC_STEP_FUSED_RS 7  // fused_two_shot.cuh
#define FC_STEP_FUSED_AG 8
#define FC_STEP_ISL_RS 9    // two_shot_islands.cuh: the island reduce-scatter
#define FC_STEP_ISL_X 10    // the exchange across islands
#define FC_STEP_ISL_AG 11   // the island all-gather

// Written by the first thread that times out, read by the host (pinned, mapped memory survives the trap).
struct FcError {
  u32 code;  // 0: none; 1: timeout. Written last, after the other fields.
  u32 rank;
  u32 peer;
  u32 step;
  u32 epoch;
  u32 block;
  u32 group;
  u32 pad;
};

// Everything a kernel needs to find its peers, written once when the workspace is built (device memory).
// Each table is one communication group (all ranks, or an island, or the partners across islands) with its
// own epoch counter, so that the double-buffer argument below holds per group.
//
// Buffers come in two halves picked by the epoch's parity. Why two are enough: a rank writes into a peer's
// half h for call k+2 only after finishing call k+1, and call k+1 cannot finish before that peer has sent
// its call-(k+1) data, which it does only after its own call k (stream order). So the peer is done reading
// half h of call k before anyone overwrites it. Every algorithm receives from every rank it sends to,
// which is what the argument needs.
struct FcTable {
  u32 rank;        // my index in this group
  u32 world;       // group size
  u32 group_id;    // for error messages: 0 flat, 1 island, 2 partners
  u32 global_rank; // my rank in the whole workspace
  u32 global_of[FC_MAX_WORLD];  // group index -> global rank, for error messages
  u64 timeout_ns;
  FcError* err;    // host-mapped
  u32* state;      // my own device memory: [0] last completed epoch, [1] blocks done in this launch,
                   // [2] Lamport buffer of the last one-shot, [3] bytes of each slot that call wrote
  char* scratch;   // my own device memory, FC_MAX_BLOCKS x 2 packets (no kernel uses it since the fused op
                   // stopped swapping partial sums between blocks)

  // Flag-in-data packet slots (epoch twice per 8 data bytes). No kernel here uses them any more: the
  // one-shot and the fused op moved to the Lamport slots below. Push: where my packets go (P2P: every
  // peer's slot for me; host: my one host slot).
  u32 n_ll_push;
  u32 n_ag_push;
  char* ll_push[2][FC_MAX_WORLD];
  char* ll_pull[2][FC_MAX_WORLD];  // [half][src]: where src's packets arrive for me

  // Two-shot. rs_push[h][s]: where I put my copy of segment s (s != rank); rs_pull[h][p]: where rank p's
  // copy of my segment lands. Flags are arrays of FC_MAX_BLOCKS words, one per block.
  char* rs_push[2][FC_MAX_WORLD];
  char* rs_pull[2][FC_MAX_WORLD];
  u32* rs_flag_push[2][FC_MAX_WORLD];
  u32* rs_flag_pull[2][FC_MAX_WORLD];
  char* ag_push[2][FC_MAX_WORLD];   // n_ag_push destinations of my reduced segment
  u32* ag_flag_push[2][FC_MAX_WORLD];
  char* ag_pull[2][FC_MAX_WORLD];   // [h][p]: where segment p's result arrives
  u32* ag_flag_pull[2][FC_MAX_WORLD];

  // One-shot, Lamport style (payload only, readiness is "no element holds the sentinel"; see the
  // Lamport section below). Three buffers, rotated by state[2]. P2P: lp_push[b][j] is my slot in peer j's
  // buffer, lp_pull[b][s] the slot where s's data lands in mine. Host: lp_push[b][0] is my one slot of the
  // host segment, lp_pull[b][s] rank s's slot (lp_pull[b][rank] == lp_push[b][0]).
  u32 host;        // 1: host transport, 0: P2P (decides who clears a slot, and when)
  u32 n_lp_push;
  char* lp_push[FC_LP_BUFFERS][FC_MAX_WORLD];
  char* lp_pull[FC_LP_BUFFERS][FC_MAX_WORLD];

  // Pull (pull.cuh), P2P only; two halves by the epoch's parity, the argument above. pull_buf[h][s]: rank
  // s's copy of its input (s == rank: my own, local); pull_red[h][s]: rank s's reduced segment (two-stage).
  // Flags: arrays of 2 x FC_MAX_BLOCKS words, [phase][block]; pull_flag_pull[h][s] is where rank s's flags
  // land in my memory, pull_flag_push[h][j] my flag array in rank j's memory (j != rank; by group rank).
  char* pull_buf[2][FC_MAX_WORLD];
  char* pull_red[2][FC_MAX_WORLD];
  u32* pull_flag_pull[2][FC_MAX_WORLD];
  u32* pull_flag_push[2][FC_MAX_WORLD];
};

// ---- memory operations ---------------------------------------------------------------------------------

// Flag release: every write this thread (and, through the preceding __syncthreads, its block) made before
// becomes visible to whoever acquires the flag, at system scope (peer GPUs and host memory).
__device__ __forceinline__ void fc_st_release_sys(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 fc_ld_acquire_sys(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Data written by a peer: bypass L1 (not coherent with remote writers).
__device__ __forceinline__ uint4 fc_load_cv16(const char* p) {
  uint4 v;
  asm volatile("ld.volatile.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// Release pattern for several flags at once: one system-scope fence, then plain (relaxed) stores, so a block
// publishing to W-1 peers pays for one fence, not W-1 releases. The fence is cumulative over the writes the
// block made before the preceding __syncthreads.
__device__ __forceinline__ void fc_fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ void fc_st_relaxed_sys(u32* p, u32 v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u64 fc_globaltimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---- bounded waits --------------------------------------------------------------------------------------

// Record who stalled, then kill the context: a wrong result must never escape. The host reads the record
// (fastcomm.errors) to turn CUDA's generic launch failure into a message naming rank, peer and step.
__device__ __noinline__ void fc_fail(const FcTable* t, u32 src, u32 step, u32 epoch) {
  FcError* e = t->err;
  volatile u32* v = reinterpret_cast<volatile u32*>(e);
  v[1] = t->global_rank;
  v[2] = t->global_of[src];
  v[3] = step;
  v[4] = epoch;
  v[5] = blockIdx.x;
  v[6] = t->group_id;
  __threadfence_system();
  v[0] = 1;
  __threadfence_system();
  __trap();
}

// Spin-wait helper: the clock is read only every 1024 polls, which keeps the loop tight.
struct FcDeadline {
  u64 limit;
  u32 polls;
  __device__ __forceinline__ explicit FcDeadline(u64 timeout_ns) : limit(fc_globaltimer() + timeout_ns), polls(0) {}
  __device__ __forceinline__ bool expired() {
    if ((++polls & 1023u) != 0) return false;
    return fc_globaltimer() > limit;
  }
};

__device__ __forceinline__ void fc_wait_flag(const FcTable* t, const u32* flag, u32 epoch, u32 src, u32 step) {
  if (fc_ld_acquire_sys(flag) == epoch) return;
  FcDeadline dl(t->timeout_ns);
  while (fc_ld_acquire_sys(flag) != epoch) {
    if (dl.expired()) fc_fail(t, src, step, epoch);
  }
}

// ---- epochs ---------------------------------------------------------------------------------------------

// The epoch of this launch: one more than the last completed launch on this group. It lives in device
// memory (not a kernel argument) so that CUDA-graph replays, whose arguments are frozen, still advance it.
// 0 is never used (buffers start zeroed); skipping to 2 keeps the parity alternating across the wrap.
// Limit: flags are 32-bit, so a packet left unwritten at one index for exactly 2^32 calls of its group
// would carry a valid-looking epoch again. At 10^4 calls/s that is ~5 days of a packet index unused by
// every call in between, then read before its writer arrives; not prevented, only this unlikely.
__device__ __forceinline__ u32 fc_next_epoch(u32 last) {
  u32 e = last + 1u;
  return e == 0u ? 2u : e;
}

__device__ __forceinline__ u32 fc_begin(const FcTable* t) {
  return fc_next_epoch(*reinterpret_cast<volatile u32*>(&t->state[0]));
}

// The last block to finish publishes the epoch; by then every block has read the old value (each block
// used it before arriving here), so no fence is needed. The next launch on the stream sees the new value
// (kernel boundary). Only this GPU's own memory is touched atomically.
__device__ __forceinline__ void fc_end(const FcTable* t, u32 epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    u32 done = atomicAdd(&t->state[1], 1u);
    if (done == gridDim.x - 1) {
      t->state[1] = 0u;
      t->state[0] = epoch;
    }
  }
}

#include "dtypes.cuh"

// ---- Lamport one-shot: readiness in the data itself ------------------------------------------------------
//
// A slot element "has not arrived" while it holds the sentinel: all ones (0xFFFF for bf16/fp16,
// 0xFFFFFFFF for fp32, a negative NaN in each). The sender replaces an element equal to the sentinel by
// that dtype's canonical NaN (fc_lp_sanitize), on every rank for its own term too, so all ranks add the same
// bits; -0.0, +-inf and every other value travel unchanged and NaN stays NaN. The payload alone crosses the
// link (16-byte stores, no flags). Each element is checked on its own, so a 16-byte store that lands in
// pieces (only 8-byte halves are single-copy atomic) is read correctly: a vector is taken once no element
// of it is the sentinel, and an element, once written, keeps its value until a clear in a later call.
//
// Buffers and clears. Counting only the calls that use these slots (one-shot, fused, fused two-shot and the
// Lamport two-shot, which share them; two_shot_ll.cuh and fused_two_shot.cuh say why they may), call c of a
// group uses buffer c mod 3 (state[2], in device memory so graph replays advance it).
// Every slot starts as the sentinel (fastcomm.layout sentinel_regions: the workspace fills them with 0xFF)
// and is put back to the sentinel, over the bytes the call wrote (state[3]), one call later, in call c+1,
// by the only rank that may:
//  - P2P (slots in the receiver's memory, each read only by their owner): the receiver clears its receive
//    slots of buffer (c-1) mod 3 at the start of call c: its own call c-1 kernel, the only reader, has
//    finished (stream order). The next write into that buffer is some peer's call c+2, which the peer
//    starts only after finishing c+1, which needs this rank's call-c+1 data, pushed after this kernel (and
//    its clears) completed. Two buffers would not do: a peer one call ahead writes the next buffer while
//    the receiver still clears it.
//  - Host (rank s's slot in host memory is read by every peer): s clears its own slot of buffer
//    (c-1) mod 3 in call c, but only after it has seen call-c data from every peer (any element): a peer
//    writes call-c data only after its call c-1 kernel (the reads of s's c-1 slot) has finished. s writes
//    that slot again in call c+2, and a reader reaches call c+2 only after seeing s's call-c+1 data,
//    written after s's call-c kernel (the clear) completed, so it reads the sentinel or call-c+2 data,
//    never call c-1's.
// "Needs this rank's data" holds for every kernel on these slots: a peer's grid reads data from every rank
// before its kernel ends (the one-shot and fused op every vector of the message, the Lamport two-shot every
// segment, the fused two-shot every owner's part; fused_two_shot.cuh says how its slots are laid out).
// Flagged two-shot calls on the group touch neither these buffers nor state[2..3]; they only move the
// epoch, which here names the call in error messages.

template <class D>
struct FcLamport;

template <>
struct FcLamport<FcBF16> {
  static __device__ __forceinline__ u32 nan_bits() { return 0x7FC0u; }
};
template <>
struct FcLamport<FcF16> {
  static __device__ __forceinline__ u32 nan_bits() { return 0x7E00u; }
};
template <>
struct FcLamport<FcF32> {
  static __device__ __forceinline__ u32 nan_bits() { return 0x7FC00000u; }
};

// Per 32-bit word: two 16-bit elements, or one fp32.
template <class D>
__device__ __forceinline__ u32 fc_lp_sanitize_word(u32 w) {
  if (sizeof(typename D::raw) == 4) return w == 0xFFFFFFFFu ? FcLamport<D>::nan_bits() : w;
  u32 lo = w & 0xFFFFu, hi = w >> 16;
  if (lo == 0xFFFFu) lo = FcLamport<D>::nan_bits();
  if (hi == 0xFFFFu) hi = FcLamport<D>::nan_bits();
  return lo | (hi << 16);
}

template <class D>
__device__ __forceinline__ bool fc_lp_word_arrived(u32 w) {
  if (sizeof(typename D::raw) == 4) return w != 0xFFFFFFFFu;
  return (w & 0xFFFFu) != 0xFFFFu && (w >> 16) != 0xFFFFu;
}

template <class D>
__device__ __forceinline__ uint4 fc_lp_sanitize(uint4 v) {
  return make_uint4(fc_lp_sanitize_word<D>(v.x), fc_lp_sanitize_word<D>(v.y), fc_lp_sanitize_word<D>(v.z),
                    fc_lp_sanitize_word<D>(v.w));
}

template <class D>
__device__ __forceinline__ bool fc_lp_arrived(uint4 v) {
  return fc_lp_word_arrived<D>(v.x) && fc_lp_word_arrived<D>(v.y) && fc_lp_word_arrived<D>(v.z) &&
         fc_lp_word_arrived<D>(v.w);
}

// No "memory" clobber, as for packets: these order nothing but themselves, and the loads of every source
// must be in flight together.
__device__ __forceinline__ uint4 fc_lp_load(const char* p) {
  uint4 v;
  asm volatile("ld.volatile.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void fc_lp_store(char* p, uint4 v) {
  asm volatile("st.volatile.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// v to every reader of my vector at byte offset `off` of buffer b: each of the npush (t->n_lp_push, read
// once by the caller) peers' slots for me over P2P or my one host slot, and over P2P my own slot too (my
// sibling blocks read my term there, as the peers' terms).
__device__ __forceinline__ void fc_lp_push(const FcTable* __restrict__ t, u32 npush, u32 b, u64 off, uint4 v) {
  for (u32 p = 0; p < npush; ++p) fc_lp_store(t->lp_push[b][p] + off, v);
  if (!t->host) fc_lp_store(t->lp_pull[b][t->rank] + off, v);
}

// Vector i (16 bytes) of a byte range [base, base+limit): whole when inside and aligned, else byte by byte
// with zero padding (zero is never the sentinel, so a message tail arrives like any other vector).
__device__ __forceinline__ uint4 fc_load_vec(const char* base, u64 i, u64 limit) {
  const u64 off = i * FC_VEC_BYTES;
  const char* p = base + off;
  if (off + FC_VEC_BYTES <= limit && ((reinterpret_cast<u64>(p) & 15u) == 0)) return *reinterpret_cast<const uint4*>(p);
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  char* d = reinterpret_cast<char*>(&v);
  const u64 n = limit - off < FC_VEC_BYTES ? limit - off : FC_VEC_BYTES;
  for (u64 b = 0; b < n; ++b) d[b] = p[b];
  return v;
}

__device__ __forceinline__ void fc_store_vec(char* base, u64 i, u64 limit, uint4 v) {
  const u64 off = i * FC_VEC_BYTES;
  char* p = base + off;
  if (off + FC_VEC_BYTES <= limit && ((reinterpret_cast<u64>(p) & 15u) == 0)) {
    *reinterpret_cast<uint4*>(p) = v;
    return;
  }
  const char* s = reinterpret_cast<const char*>(&v);
  const u64 n = limit - off < FC_VEC_BYTES ? limit - off : FC_VEC_BYTES;
  for (u64 b = 0; b < n; ++b) p[b] = s[b];
}

// 16 bytes as elements of D.
template <class D>
struct FcVec {
  static constexpr int N = FC_VEC_BYTES / sizeof(typename D::raw);
  __device__ static __forceinline__ void unpack(uint4 v, float* out) {
    typename D::raw r[N];
    *reinterpret_cast<uint4*>(r) = v;
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = D::to_f(r[i]);
  }
  __device__ static __forceinline__ uint4 pack(const float* in) {
    typename D::raw r[N];
#pragma unroll
    for (int i = 0; i < N; ++i) r[i] = D::from_f(in[i]);
    return *reinterpret_cast<uint4*>(r);
  }
};

// Vector `off` (a byte offset into every source's slot of buffer b) from every rank, summed in rank order
// 0..world-1 (the same order on every rank, and the first term seeds the sum, which keeps an all -0.0
// input -0.0 as NCCL does). `mine` is this rank's own, already sanitized term. Every source's load is
// issued first; then each round re-loads every source still pending, so the waits overlap instead of adding
// up, and the deadline bounds the whole wait.
//
// OWN_FROM_SLOT: read this rank's term from its own slot too (lp_pull[b][rank]) instead of `mine`: the fused
// op, whose blocks read vectors their siblings pushed.
template <class D, bool OWN_FROM_SLOT = false>
__device__ __forceinline__ void fc_lp_gather_sum(const FcTable* t, u32 b, u64 off, uint4 mine, u32 step, u32 epoch,
                                                 float* acc) {
  typedef FcVec<D> V;
  const u32 world = t->world, me = t->rank;
  uint4 v[FC_MAX_WORLD];
  u32 pending = 0;
#pragma unroll
  for (u32 s = 0; s < FC_MAX_WORLD; ++s)
    if (s < world && (OWN_FROM_SLOT || s != me)) v[s] = fc_lp_load(t->lp_pull[b][s] + off);
#pragma unroll
  for (u32 s = 0; s < FC_MAX_WORLD; ++s)
    if (s < world && (OWN_FROM_SLOT || s != me) && !fc_lp_arrived<D>(v[s])) pending |= 1u << s;
  if (pending) {
    FcDeadline dl(t->timeout_ns);
    do {
      if (dl.expired()) fc_fail(t, __ffs(pending) - 1, step, epoch);
#pragma unroll
      for (u32 s = 0; s < FC_MAX_WORLD; ++s)
        if (pending & (1u << s)) v[s] = fc_lp_load(t->lp_pull[b][s] + off);
#pragma unroll
      for (u32 s = 0; s < FC_MAX_WORLD; ++s)
        if ((pending & (1u << s)) && fc_lp_arrived<D>(v[s])) pending &= ~(1u << s);
    } while (pending);
  }
#pragma unroll
  for (u32 s = 0; s < FC_MAX_WORLD; ++s) {
    if (s < world) {
      float f[V::N];
      V::unpack((s == me && !OWN_FROM_SLOT) ? mine : v[s], f);
#pragma unroll
      for (int e = 0; e < V::N; ++e) acc[e] = (s == 0) ? f[e] : acc[e] + f[e];
    }
  }
}

// Host transport only: wait until the vector at byte `off` of every peer's slot (vector 0 by default) of
// this call has arrived (one thread per source). A block that gathered no vector itself uses it before
// clearing its own slot (see above). `off` must name a vector every peer writes in every call: the
// two-shot kernels pass their all-gather area, since not every rank writes vector 0 of the others'.
template <class D>
__device__ __forceinline__ void fc_lp_wait_first(const FcTable* t, u32 b, u32 step, u32 epoch, u64 off = 0) {
  const u32 s = threadIdx.x;
  if (s < t->world && s != t->rank) {
    const char* p = t->lp_pull[b][s] + off;
    if (!fc_lp_arrived<D>(fc_lp_load(p))) {
      FcDeadline dl(t->timeout_ns);
      while (!fc_lp_arrived<D>(fc_lp_load(p)))
        if (dl.expired()) fc_fail(t, s, step, epoch);
    }
  }
}

// Sentinel over the first `bytes` of a slot (bytes is a multiple of 16), grid-strided.
__device__ __forceinline__ void fc_lp_clear(char* slot, u64 bytes) {
  const uint4 ones = make_uint4(0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu);
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < bytes / FC_VEC_BYTES; i += (u64)gridDim.x * blockDim.x)
    fc_lp_store(slot + i * FC_VEC_BYTES, ones);
}

struct FcLpCall {
  u32 epoch;       // for error messages (and the other kernels' flags)
  u32 buf;         // this call's buffer
  u32 prev;        // the previous Lamport call's buffer (any kernel on these slots), to clear
  u32 prev_bytes;  // bytes of each slot it wrote
};

__device__ __forceinline__ FcLpCall fc_lp_begin(const FcTable* t) {
  const volatile u32* st = t->state;
  FcLpCall c;
  c.epoch = fc_next_epoch(st[0]);
  c.prev = st[2];
  c.buf = c.prev + 1u == FC_LP_BUFFERS ? 0u : c.prev + 1u;
  c.prev_bytes = st[3];
  return c;
}

// P2P: my receive slots of the previous call's buffer, own slot included (the fused op writes it), are
// mine alone to read, and that reader (my previous kernel) has finished: clear them, at any point of this
// call. Host: nothing (see fc_lp_clear_own_after_gather).
__device__ __forceinline__ void fc_lp_clear_received(const FcTable* t, const FcLpCall& c) {
  if (t->host) return;
  for (u32 s = 0; s < t->world; ++s) fc_lp_clear(t->lp_pull[c.prev][s], c.prev_bytes);
}

// Host: my own slot of the previous buffer is read by every peer. A block may clear its share once it has
// seen call-c data from every peer (then every peer's call c-1 kernel is over): any thread of the block
// that gathered a vector (`gathered`) saw all of them; a block without one waits for the vector at byte
// `first_off` of every peer's slot (fc_lp_wait_first). Called by every thread of the block, after its
// gathers.
template <class D>
__device__ __forceinline__ void fc_lp_clear_own_after_gather(const FcTable* t, const FcLpCall& c, bool gathered,
                                                             u32 step, u64 first_off = 0) {
  if (!t->host) return;
  if (!__syncthreads_or(gathered)) fc_lp_wait_first<D>(t, c.buf, step, c.epoch, first_off);
  __syncthreads();
  fc_lp_clear(t->lp_push[c.prev][0], c.prev_bytes);
}

// As fc_end, and the last block also records this call's buffer and size for the next call's clear. Every
// block read state[2..3] in fc_lp_begin before it arrived here.
__device__ __forceinline__ void fc_lp_end(const FcTable* t, const FcLpCall& c, u32 bytes) {
  __syncthreads();
  if (threadIdx.x == 0) {
    u32 done = atomicAdd(&t->state[1], 1u);
    if (done == gridDim.x - 1) {
      t->state[1] = 0u;
      t->state[2] = c.buf;
      t->state[3] = bytes;
      t->state[0] = c.epoch;
    }
  }
}

static_assert(sizeof(FcTable) == 2272, "FcTable layout must match fastcomm/abi.py (TABLE_BYTES)");
static_assert(sizeof(FcError) == 32, "FcError layout must match fastcomm/abi.py (ERROR_BYTES)");
