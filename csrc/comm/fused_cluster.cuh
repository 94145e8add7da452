// Fused all-reduce + residual add + RMSNorm, one thread-block cluster per row (sm_90+).
//
// fused_rmsnorm.cuh lets every block of a row read the WHOLE row from the slots, so that no block waits on
// a sibling's partial sum. Here the `splits` blocks of a row form one cluster: each block reads only its
// own chunk of the row from the slots, reduces that chunk's sum of squares, and the blocks swap the
// partials through distributed shared memory (one cluster barrier per row). The exchange, message layout,
// buffers, rotation and clears are the fused op's (one-shot slots, common.cuh), so calls of every Lamport
// kernel can follow each other in any order.
//
// Rounding: as fused_rmsnorm.cuh (a = D(sum in rank order), z = a + residual in fp32, residual_out = D(z),
// variance over the unrounded z, out = D(z * inv_rms * weight)); only the order of the row's sum of squares
// differs, and it is fixed: thread t of split s adds the z^2 of vectors c0 + t, c0 + t + blockDim, ... of
// its chunk in that order (element order inside a vector), fc_block_sum adds the threads in a fixed tree
// (warp xor shuffles, then warps 0..n-1), and every block adds the `splits` partials in cluster-rank order
// 0..splits-1, seeded by the first. Each of these depends only on (row, hidden, dtype, splits, blockDim),
// which the host derives from shapes and the plan alone, and every block reads the same partial bits, so
// every block of a row and every rank get the same inv_rms bits. (Not the same bits as fused_rmsnorm.cuh's
// order: ranks must all take this form or all the other; policy.fused.fused_cluster_form decides from
// settings and device facts, the same on every rank of one GPU model.)
//
// Clusters: launched with the cluster dimension (splits, 1, 1) (cuLaunchKernelEx), so the blocks of one
// cluster are blockIdx.x = c * splits + s, s = %cluster_ctarank, and item (row, split) grid-strides with
// split == s on every round; every block of a cluster runs the same number of rounds (gridDim.x is a
// multiple of splits), so the cluster barriers match. The grid is capped at what can be resident at once
// (cuOccupancyMaxActiveClusters x splits, and the plan's max_blocks): a block waits on the same vectors of
// its peers' blocks and on the previous row's block for a vector straddling the two rows, which pushes
// before it waits, as in fused_rmsnorm.cuh.
//
// The cluster barrier has no deadline of its own: a sibling reaches it or traps on its own bounded waits
// (its gathers), which ends the kernel, so the barrier is bounded by theirs.
//
// Partials are double-buffered by round parity: block s writes part[k & 1] in round k; a sibling reads it
// after barrier k and arrives at barrier k+1 only after that read, and s writes the same word again in
// round k+2, after barrier k+1. A final barrier keeps every block's shared memory alive until its siblings
// have read it.
//
// Aliasing (out may be x, residual_out may be residual): x vector j is read only by the block that pushes
// it, before any output byte depending on it exists (as fused_rmsnorm.cuh). The residual of a chunk is read
// only by the block writing that chunk, each vector by the same thread in both passes before it writes it
// (a vector straddling two rows is also read by the other row's block, which uses only its own lanes), so
// rows may be split even when an output overlaps the residual, and on the host transport (each block reads
// only its chunk from host memory).
#pragma once
#include "common.cuh"
#include "fused_rmsnorm.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ u32 fc_cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ u32 fc_cluster_size() {
  u32 n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return n;
}

// Every thread of every block of the cluster: shared-memory writes before it are visible after it to the
// whole cluster (arrive has release, wait acquire semantics at cluster scope).
__device__ __forceinline__ void fc_cluster_sync() {
  asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}

// A float in cluster block `rank`'s shared memory, at the address `p` has in mine.
__device__ __forceinline__ float fc_cluster_ld(const float* p, u32 rank) {
  float v;
  asm volatile(
      "{\n\t.reg .u64 g;\n\t.reg .u32 s, r;\n\t"
      "cvta.to.shared.u64 g, %1;\n\tcvt.u32.u64 s, g;\n\t"
      "mapa.shared::cluster.u32 r, s, %2;\n\tld.shared::cluster.f32 %0, [r];\n\t}"
      : "=f"(v)
      : "l"(p), "r"(rank)
      : "memory");
  return v;
}
#endif

template <class D>
__device__ __forceinline__ void fc_fused_cluster(const FcTable* __restrict__ t, const char* in, const char* residual,
                                                 const char* __restrict__ weight, char* out, char* residual_out,
                                                 u32 tokens, u32 hidden, u32 splits, float eps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  typedef FcVec<D> V;
  typedef typename D::raw R;
  __shared__ float smem32[32];
  __shared__ float part[2];

  // The cluster shape is the launch's, the chunking the argument's: a mismatch would mix rows' partials.
  if (fc_cluster_size() != splits || fc_cluster_rank() != blockIdx.x % splits) __trap();

  const FcLpCall c = fc_lp_begin(t);
  const u32 npush = t->n_lp_push;
  const u64 row_bytes = (u64)hidden * sizeof(R);
  const u64 total = (u64)tokens * row_bytes;
  const u64 nvec = (total + FC_VEC_BYTES - 1) / FC_VEC_BYTES;
  const u32 items = tokens * splits;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

  fc_lp_clear_received(t, c);

  bool gathered = false;
  u32 round = 0;
  for (u32 item = blockIdx.x; item < items; item += gridDim.x, ++round) {
    const u32 row = item / splits;
    const u32 split = item % splits;
    const u64 e0 = (u64)row * hidden, e1 = e0 + hidden;
    const u64 lo = (u64)row * row_bytes / FC_VEC_BYTES;
    const u64 hi = ((u64)(row + 1) * row_bytes + FC_VEC_BYTES - 1) / FC_VEC_BYTES;
    const u64 own_lo = ((u64)row * row_bytes + FC_VEC_BYTES - 1) / FC_VEC_BYTES;
    const u64 chunk = (hi - lo + splits - 1) / splits;
    const u64 c0 = lo + (u64)split * chunk;
    const u64 c1 = c0 + chunk < hi ? c0 + chunk : hi;

    // 1. Push the vectors of my chunk that start in this row (fused_rmsnorm.cuh, step 1, without islands).
    for (u64 j = (c0 > own_lo ? c0 : own_lo) + threadIdx.x; j < c1; j += blockDim.x) {
      const uint4 mine = fc_lp_sanitize<D>(fc_load_vec(in, j, total));
      fc_lp_push(t, npush, c.buf, j * FC_VEC_BYTES, mine);
    }

    // 2. My chunk only: a = D(sum over ranks in rank order), z = a + residual, its sum of squares.
    float ss = 0.f;
    for (u64 j = c0 + threadIdx.x; j < c1; j += blockDim.x) {
      float acc[V::N];
      fc_lp_gather_sum<D, true>(t, c.buf, j * FC_VEC_BYTES, zero, FC_STEP_FUSED, c.epoch, acc);
      gathered = true;
      const uint4 rv = residual ? fc_load_vec(residual, j, total) : zero;
      const R* rr = reinterpret_cast<const R*>(&rv);
#pragma unroll
      for (int e = 0; e < V::N; ++e) {
        const u64 g = j * V::N + e;
        if (g >= e0 && g < e1) {
          const float a = D::to_f(D::from_f(acc[e]));
          const float z = residual ? a + D::to_f(rr[e]) : a;  // no "+ 0" without a residual: -0 stays -0
          ss += z * z;
        }
      }
    }
    ss = fc_block_sum(ss, smem32);

    // 3. The row's sum: every block adds the cluster's partials in rank order (the same bits everywhere).
    if (threadIdx.x == 0) part[round & 1u] = ss;
    fc_cluster_sync();
    float row_ss = fc_cluster_ld(&part[round & 1u], 0);
    for (u32 s = 1; s < splits; ++s) row_ss += fc_cluster_ld(&part[round & 1u], s);
    const float inv = rsqrtf(row_ss / (float)hidden + eps);

    // 4. My chunk of the outputs (fused_rmsnorm.cuh, step 3). The data has arrived: these loads do not wait.
    fc_fused_write_chunk<D>(t, c, c0, c1, lo, e0, e1, total, row_bytes, residual, weight, out, residual_out, inv);
  }
  fc_cluster_sync();  // my part[] stays readable until every sibling has read it

  fc_lp_clear_own_after_gather<D>(t, c, gathered, FC_STEP_FUSED);
  fc_lp_end(t, c, (u32)(nvec * FC_VEC_BYTES));
#else
  __trap();  // the policy takes this form only on sm_90 and newer (policy.fused.fused_cluster_form)
#endif
}
