// Lamport two-shot: reduce-scatter then all-gather with readiness in the data (the one-shot's sentinel),
// so there is no flag, no fence and no flag round trip between the phases.
//
// The message is cut into W segments of sv 16-byte vectors each (the last ones zero-padded past the
// message, so every segment, even of a 1-element message, has at least one vector). Thread i of the grid
// handles vector i of every segment:
//   reduce-scatter: push my (sanitized) vector i of segment s to its owner s; poll vector i of my segment
//                   from every source at once; sum in rank order 0..W-1 (seeded by rank 0's term);
//   all-gather:     push the reduced vector (sanitized) to every peer; poll vector i of every other
//                   segment from its owner, all owners at once.
// A thread reads its W input vectors before it writes any output, and no other thread touches them, so out
// may alias in. -0.0, +-inf and NaN travel as in the one-shot (common.cuh, "Lamport one-shot").
//
// Slots: the one-shot's Lamport buffers (FcTable.lp_push / lp_pull, rotated by state[2], cleared by the
// one-shot's rules), each slot of lp_slot bytes used as
//   P2P  (slot of source p in the receiver's memory): [0, sb) p's copy of my segment, [sb, 2 sb) p's
//        reduced segment; 2 sb bytes per slot.
//   host (my one slot in the host segment, read by every peer): [s sb, (s+1) sb) my copy of segment s
//        (s != me), [W sb, (W+1) sb) my reduced segment; (W+1) sb bytes.
// (sb = 16 sv.) fastcomm.policy.launch.two_shot_ll_max_bytes is the largest message that fits; the policy
// never sends a larger one here.
//
// Why sharing the one-shot's buffers is safe. The rotation and clear argument in common.cuh needs, of
// every kernel that uses the slots: (1) in P2P, a slot is written only by its source and read only by its
// owner (the receiver): true here, as above; (2) in host mode, a rank writes only its own slot, and clears
// it only after seeing this call's data from every peer: true, every vector gathered here came from every
// peer (both phases read all W-1 of them), and a block that gathered none waits for each peer's first
// reduced vector first; (3) a rank's kernel cannot end before it has read this call's data from every
// peer: true thanks to the padding, every rank reads every peer in both phases; (4) state[3] holds the
// bytes of each slot the call wrote, so the next call (of any kernel on these slots) clears all of it.
// Nothing else touches the buffers, so calls of the one-shot, the fused ops (one-shot, cluster, island and
// two-shot forms) and this kernel can follow each other in any order, each taking the next buffer.
#pragma once
#include "common.cuh"

// Vector g of the message (zero past its end: zero is never the sentinel).
__device__ __forceinline__ uint4 fc_tsll_load_in(const char* in, u64 g, u64 nbytes) {
  return g * FC_VEC_BYTES < nbytes ? fc_load_vec(in, g, nbytes) : make_uint4(0u, 0u, 0u, 0u);
}

// v[p] = the vector at src[p] + off for every p != me, once none of them holds the sentinel. Every load is
// issued first; each round re-loads every source still pending, and the deadline bounds the whole wait.
template <class D, u32 W>
__device__ __forceinline__ void fc_tsll_poll(const FcTable* t, const char* const* src, u64 off, u32 me, u32 step,
                                             u32 epoch, uint4* v) {
  u32 pending = 0;
#pragma unroll
  for (u32 p = 0; p < W; ++p)
    if (p != me) v[p] = fc_lp_load(src[p] + off);
#pragma unroll
  for (u32 p = 0; p < W; ++p)
    if (p != me && !fc_lp_arrived<D>(v[p])) pending |= 1u << p;
  if (!pending) return;
  FcDeadline dl(t->timeout_ns);
  do {
    if (dl.expired()) fc_fail(t, __ffs(pending) - 1, step, epoch);
#pragma unroll
    for (u32 p = 0; p < W; ++p)
      if (pending & (1u << p)) v[p] = fc_lp_load(src[p] + off);
#pragma unroll
    for (u32 p = 0; p < W; ++p)
      if ((pending & (1u << p)) && fc_lp_arrived<D>(v[p])) pending &= ~(1u << p);
  } while (pending);
}

template <class D, u32 W>
__device__ __forceinline__ void fc_two_shot_ll_w(const FcTable* __restrict__ t, const char* in, char* out,
                                                 u64 nbytes) {
  typedef FcVec<D> V;
  const FcLpCall c = fc_lp_begin(t);
  const u32 me = t->rank;
  const bool host = t->host != 0;
  const u64 nvec = (nbytes + FC_VEC_BYTES - 1) / FC_VEC_BYTES;
  const u64 sv = (nvec + W - 1) / W;  // vectors per segment (policy.launch.two_shot_ll_launch: Launch.seg)
  const u64 sb = sv * FC_VEC_BYTES;
  const u64 rs_off = host ? (u64)me * sb : 0;  // where the copies of my segment sit in each source's slot
  const u64 ag_off = host ? (u64)W * sb : sb;  // where each owner's reduced segment sits in its slot

  fc_lp_clear_received(t, c);

  // Peer pointers, loaded once. to[s]: where my copy of segment s goes (P2P: my slot at its owner; host:
  // its place in my own slot). mine_slot: my host slot (host only).
  char* to[W];
  const char* from[W];
  char* const mine_slot = t->lp_push[c.buf][0];
#pragma unroll
  for (u32 s = 0; s < W; ++s) {
    to[s] = host ? mine_slot + (u64)s * sb : (s == me ? nullptr : t->lp_push[c.buf][s - (s > me ? 1u : 0u)]);
    from[s] = t->lp_pull[c.buf][s];
  }

  bool gathered = false;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < sv; i += (u64)gridDim.x * blockDim.x) {
    const u64 off = i * FC_VEC_BYTES;
    // 1. Reduce-scatter: every input vector read first (out may alias in), the peers' pushed at once.
    uint4 own = make_uint4(0u, 0u, 0u, 0u);
    {
      uint4 x[W];
#pragma unroll
      for (u32 s = 0; s < W; ++s) x[s] = fc_lp_sanitize<D>(fc_tsll_load_in(in, (u64)s * sv + i, nbytes));
#pragma unroll
      for (u32 s = 0; s < W; ++s) {
        if (s == me) own = x[s];
        else fc_lp_store(to[s] + off, x[s]);
      }
    }
    uint4 v[W];
    fc_tsll_poll<D, W>(t, from, rs_off + off, me, FC_STEP_RS, c.epoch, v);
    float acc[V::N];
#pragma unroll
    for (u32 p = 0; p < W; ++p) {
      float f[V::N];
      V::unpack(p == me ? own : v[p], f);
#pragma unroll
      for (int e = 0; e < V::N; ++e) acc[e] = (p == 0) ? f[e] : acc[e] + f[e];
    }
    // Sanitized for my own output too, so every rank holds the same bits.
    const uint4 r = fc_lp_sanitize<D>(V::pack(acc));

    // 2. All-gather: the reduced vector to every peer, then every other owner's vector i.
    if (host) {
      fc_lp_store(mine_slot + ag_off + off, r);
    } else {
#pragma unroll
      for (u32 s = 0; s < W; ++s)
        if (s != me) fc_lp_store(to[s] + ag_off + off, r);
    }
    const u64 gme = (u64)me * sv + i;
    if (gme < nvec) fc_store_vec(out, gme, nbytes, r);
    fc_tsll_poll<D, W>(t, from, ag_off + off, me, FC_STEP_AG, c.epoch, v);
#pragma unroll
    for (u32 p = 0; p < W; ++p) {
      const u64 g = (u64)p * sv + i;
      if (p != me && g < nvec) fc_store_vec(out, g, nbytes, v[p]);
    }
    gathered = true;
  }

  // Host: clear my own slot of the previous buffer once this block has seen this call's data from every
  // peer (rule (2) above); a block that gathered nothing waits for each peer's first reduced vector.
  fc_lp_clear_own_after_gather<D>(t, c, gathered, FC_STEP_AG, ag_off);
  fc_lp_end(t, c, (u32)(host ? (u64)(W + 1) * sb : 2 * sb));
}

template <class D>
__device__ __forceinline__ void fc_two_shot_ll(const FcTable* __restrict__ t, const char* in, char* out, u64 nbytes) {
  switch (t->world) {  // fixed for the workspace's life: a uniform branch, one entry point per dtype
    case 2: fc_two_shot_ll_w<D, 2>(t, in, out, nbytes); break;
    case 3: fc_two_shot_ll_w<D, 3>(t, in, out, nbytes); break;
    case 4: fc_two_shot_ll_w<D, 4>(t, in, out, nbytes); break;
    case 5: fc_two_shot_ll_w<D, 5>(t, in, out, nbytes); break;
    case 6: fc_two_shot_ll_w<D, 6>(t, in, out, nbytes); break;
    case 7: fc_two_shot_ll_w<D, 7>(t, in, out, nbytes); break;
    case 8: fc_two_shot_ll_w<D, 8>(t, in, out, nbytes); break;
    default: __trap();  // the plan admits 2..FC_MAX_WORLD ranks only
  }
}
