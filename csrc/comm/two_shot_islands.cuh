// Hierarchical two-shot in one launch: reduce-scatter inside the island, one exchange across the islands,
// all-gather inside the island. For a box whose islands (sockets) are joined by a slow link: each rank
// sends across it only its 1/L share of the message (to I-1 partners), where the flat two-shot sends about
// the whole message across (half its reduce-scatter and half its all-gather go to the other islands).
//
// Groups: ti is my island (L ranks, member order), tp my partners (rank i of each of the I islands, island
// order). The message is cut into L segments; island member s owns segment s, so the partners of a rank
// own the same segment. Each segment is cut into gridDim.x chunks, block b handling chunk b of every
// segment in every phase, so a block waits only for block b of its island peers and partners:
//   1. island reduce-scatter: my chunk b of every other segment goes to its owner in my island
//      (ti rs slots, flags per block, as the flat two-shot);
//   2. island sum of my segment's chunk, in member order seeded by member 0, rounded to D: the partial.
//      It is written to out (my segment) and pushed to every partner (tp ag slots: a slot per source);
//   3. across: the I partials summed in island order 0..I-1, seeded by island 0's, rounded to D: the
//      result, written over the partial in out and pushed to my island peers (ti ag slots);
//   4. island all-gather: every other segment's result from its owner.
// Rounding rule: the island sum is rounded to D before it crosses, then summed over the islands in fp32
// and rounded again: the rule of the one-shot island form (one_shot.cuh, fc_one_shot_islands), with the
// same terms in the same order, so the two agree bit for bit, and every rank gets the same bits (each
// segment is finished by its I owners from identical partials, then copied). It can differ from the flat
// sums by an ulp.
//
// Ordering: each phase is the flat two-shot's (two_shot.cuh): stores, __syncthreads, one fence.acq_rel.sys
// by thread 0, then relaxed flag stores to every destination; the reader acquires the flag in one thread
// per source and a barrier shares it. Cycles cannot form: phase 1 pushes unconditionally, phase 2 pushes
// after phase 1's data of my own island arrived, phase 3 after phase 2's of my partners.
//
// Buffers (fastcomm.layout, "island two-shot" regions): the island group's two-shot slots (rs and ag, a
// segment of the island cut each, two halves by the island epoch's parity) and the partner group's ag
// slots only (a segment of the island cut, two halves by the partner epoch's parity). The halves' reuse
// without a barrier is common.cuh's FcTable argument, per group: in each group this kernel receives from
// every rank it sends to (the island in phases 1 and 4, the partners in phase 3), its kernel reads all of
// it before ending, and every call on a group (this one, or its Lamport calls, which only move the epoch
// here) advances that group's epoch once. The two groups' epochs advance independently; each argument
// needs only its own. The Lamport slots and state[2..3] are not touched, as for the flat two-shot.
//
// out may alias in: chunk b of segment s is read from in (phase 1, or phase 2 for my own segment, by the
// thread that then writes the same bytes of out) before block b writes it in out.
#pragma once
#include "common.cuh"
#include "two_shot.cuh"

template <class D, u32 L, u32 I>
__device__ __forceinline__ void fc_two_shot_islands_w(const FcTable* __restrict__ ti, const FcTable* __restrict__ tp,
                                                      const char* in, char* out, u64 n, u64 seg, u64 chunk) {
  typedef typename D::raw R;
  const u32 ei = fc_begin(ti), ep = fc_begin(tp);
  const u32 hi = ei & 1u, hp = ep & 1u;
  const u32 me = ti->rank, isl = tp->rank;
  const u64 base = (u64)blockIdx.x * chunk;  // this block's element offset inside every segment

  u64 cnt[L];  // elements of my chunk in segment s; non-increasing in s
#pragma unroll
  for (u32 s = 0; s < L; ++s) cnt[s] = fc_chunk_count(n, seg, chunk, s);
  const u64 count = fc_chunk_count(n, seg, chunk, me);  // my segment's (cnt[me] would spill cnt[])
  char* dout = out + ((u64)me * seg + base) * sizeof(R);

  // 1. Island reduce-scatter, send (two_shot.cuh's scatter on the island's table).
  fc_ts_scatter<D, L>(ti, hi, me, in, seg, base, cnt, ei);

  // 2. The island partial of my chunk (member order, rounded to D): into out, and to every partner.
  fc_wait_all(ti, ti->rs_flag_pull[hi], ei, FC_STEP_ISL_RS);
  {
    const char* src[L];
    fc_ts_sources<R>(ti->rs_pull[hi], me, in + ((u64)me * seg + base) * sizeof(R), base, src);
    char* xd[I - 1];
    u32* xf[I - 1];
    const u32 nx = fc_ts_ag_dests<R>(tp, hp, base, xd, xf);  // I-1 partners (P2P) or my one host slot
    fc_ts_reduce_push<D, L, I - 1>(src, me, count, dout, xd, xf, nx, ep);
  }

  // 3. Across: the partials in island order (mine from out, where this block put it), rounded to D: the
  // result, over the partial in out and to every island peer.
  fc_wait_all(tp, tp->ag_flag_pull[hp], ep, FC_STEP_ISL_X);
  {
    const char* src[I];
    fc_ts_sources<R>(tp->ag_pull[hp], isl, dout, base, src);
    char* agd[L - 1];  // L >= 2: islands of one rank never come here (fc_two_shot_islands)
    u32* agf[L - 1];
    const u32 nag = fc_ts_ag_dests<R>(ti, hi, base, agd, agf);  // L-1 island peers (P2P) or my one host slot
    fc_ts_reduce_push<D, I, L - 1>(src, isl, count, dout, agd, agf, nag, ei);
  }

  // 4. Island all-gather, receive: every other segment's result, all owners' loads in flight together.
  fc_wait_all(ti, ti->ag_flag_pull[hi], ei, FC_STEP_ISL_AG);
  fc_ts_gather<D, L>(ti, hi, me, out, seg, base, cnt);
  fc_end(ti, ei);
  fc_end(tp, ep);
}

// One entry point per dtype (kernels.cu); the (island size, islands) pair is fixed for the workspace's
// life, so the branch is uniform. Islands of one rank have nothing to reduce inside: the plan never sends
// them here (policy.rules.choose_algo), and the island size times the island count is at most FC_MAX_WORLD.
template <class D>
__device__ __forceinline__ void fc_two_shot_islands(const FcTable* __restrict__ ti, const FcTable* __restrict__ tp,
                                                    const char* in, char* out, u64 n, u64 seg, u64 chunk) {
  switch (ti->world * 16u + tp->world) {
    case 2 * 16 + 2: fc_two_shot_islands_w<D, 2, 2>(ti, tp, in, out, n, seg, chunk); break;
    case 2 * 16 + 3: fc_two_shot_islands_w<D, 2, 3>(ti, tp, in, out, n, seg, chunk); break;
    case 2 * 16 + 4: fc_two_shot_islands_w<D, 2, 4>(ti, tp, in, out, n, seg, chunk); break;
    case 3 * 16 + 2: fc_two_shot_islands_w<D, 3, 2>(ti, tp, in, out, n, seg, chunk); break;
    case 4 * 16 + 2: fc_two_shot_islands_w<D, 4, 2>(ti, tp, in, out, n, seg, chunk); break;
    default: __trap();
  }
}
