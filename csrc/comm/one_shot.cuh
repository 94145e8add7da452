// One-shot all-reduce for small messages, Lamport style.
//
// Every rank pushes its whole input, payload only, into each peer's receive slot (P2P) or into its own
// slot of the shared host segment (host transport), then reads every rank's data from the pull side and
// sums it locally. One hop, no flag and no barrier: an element is ready once it no longer holds the
// sentinel (common.cuh, "Lamport one-shot": the sentinel, the three rotating buffers, who clears what and
// why that is safe without a barrier).
//
// Each thread owns whole 16-byte vectors; it reads only the vectors it pushed itself (same index on every
// rank), so blocks never wait on each other, only on the same vectors of their peers. For the same reason
// out may alias in: a thread reads its input vector before it writes the same bytes of the output.
#pragma once
#include "common.cuh"

template <class D>
__device__ __forceinline__ void fc_one_shot(const FcTable* __restrict__ t, const char* in, char* out, u64 nbytes) {
  typedef FcVec<D> V;
  const FcLpCall c = fc_lp_begin(t);
  const u32 npush = t->n_lp_push;
  const u64 nvec = (nbytes + FC_VEC_BYTES - 1) / FC_VEC_BYTES;

  fc_lp_clear_received(t, c);

  bool gathered = false;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += (u64)gridDim.x * blockDim.x) {
    const uint4 mine = fc_lp_sanitize<D>(fc_load_vec(in, i, nbytes));
    for (u32 j = 0; j < npush; ++j) fc_lp_store(t->lp_push[c.buf][j] + i * FC_VEC_BYTES, mine);
    float acc[V::N];
    fc_lp_gather_sum<D>(t, c.buf, i * FC_VEC_BYTES, mine, FC_STEP_ONE_SHOT, c.epoch, acc);
    fc_store_vec(out, i, nbytes, V::pack(acc));
    gathered = true;
  }

  fc_lp_clear_own_after_gather<D>(t, c, gathered, FC_STEP_ONE_SHOT);
  fc_lp_end(t, c, (u32)(nvec * FC_VEC_BYTES));
}

// The hierarchical one-shot in one launch: sum inside the island (table ti), then across the partners
// (table tp: rank i of every island), vector by vector, so no second launch and no pass through memory.
//
// Rounding rule: the island sum is rounded to D before it crosses (then summed over the islands in island
// order, in fp32, and rounded again), exactly what the two launches it replaces computed. Every member of
// an island computes the same island sum (same terms, same order), and every rank adds the same partials
// in the same order, so all ranks agree bit for bit. It can differ from the flat one-shot by an ulp.
//
// Each group keeps its own buffers, rotation and clears (common.cuh); both advance once per launch. A
// thread waits only on the same vector of its island peers, then of its partners, each of which pushes
// before it waits, so the two waits cannot close a cycle.
template <class D>
__device__ __forceinline__ void fc_one_shot_islands(const FcTable* __restrict__ ti, const FcTable* __restrict__ tp,
                                                    const char* in, char* out, u64 nbytes) {
  typedef FcVec<D> V;
  const FcLpCall ci = fc_lp_begin(ti);
  const FcLpCall cp = fc_lp_begin(tp);
  const u32 ni = ti->n_lp_push, np = tp->n_lp_push;
  const u64 nvec = (nbytes + FC_VEC_BYTES - 1) / FC_VEC_BYTES;

  fc_lp_clear_received(ti, ci);
  fc_lp_clear_received(tp, cp);

  bool gathered = false;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += (u64)gridDim.x * blockDim.x) {
    const u64 off = i * FC_VEC_BYTES;
    const uint4 mine = fc_lp_sanitize<D>(fc_load_vec(in, i, nbytes));
    for (u32 j = 0; j < ni; ++j) fc_lp_store(ti->lp_push[ci.buf][j] + off, mine);
    float acc[V::N];
    fc_lp_gather_sum<D>(ti, ci.buf, off, mine, FC_STEP_ONE_SHOT, ci.epoch, acc);
    const uint4 part = fc_lp_sanitize<D>(V::pack(acc));  // the island sum as D (the rule above)
    for (u32 j = 0; j < np; ++j) fc_lp_store(tp->lp_push[cp.buf][j] + off, part);
    fc_lp_gather_sum<D>(tp, cp.buf, off, part, FC_STEP_ONE_SHOT, cp.epoch, acc);
    fc_store_vec(out, i, nbytes, V::pack(acc));
    gathered = true;
  }

  fc_lp_clear_own_after_gather<D>(ti, ci, gathered, FC_STEP_ONE_SHOT);
  fc_lp_clear_own_after_gather<D>(tp, cp, gathered, FC_STEP_ONE_SHOT);
  fc_lp_end(ti, ci, (u32)(nvec * FC_VEC_BYTES));
  fc_lp_end(tp, cp, (u32)(nvec * FC_VEC_BYTES));
}
