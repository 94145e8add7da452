// One-shot all-reduce for small messages.
//
// Every rank pushes its whole input, as flag-in-data packets, into each peer's receive slot (P2P) or into
// its own slot of the shared host segment (host transport), then reads every rank's packets from the pull
// side and sums them locally. One hop, no barrier round trip: a packet is ready when both its flags carry
// this launch's epoch, so the reader never waits for anything but the data itself.
//
// Each thread owns whole packets; it reads only the packets it pushed itself (same index on every rank),
// so blocks never wait on each other, only on the same-index block of their peers. For the same reason
// out may alias in: a thread reads its input packet before it writes the same bytes of the output.
#pragma once
#include "common.cuh"

template <class D>
__device__ __forceinline__ void fc_one_shot(const FcTable* __restrict__ t, const char* in,
                                            char* out, u64 nbytes) {
  typedef FcPayload<D> P;
  const u32 epoch = fc_begin(t);
  const u32 h = epoch & 1u;
  const u32 npush = t->n_ll_push;
  const u64 npk = (nbytes + FC_PACKET_PAYLOAD - 1) / FC_PACKET_PAYLOAD;

  // Two packets per thread per pass (i and i + stride): twice the loads in flight per round trip.
  const u64 stride = (u64)gridDim.x * blockDim.x;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < npk; i += 2 * stride) {
    const u64 off[2] = {i * FC_PACKET_BYTES, (i + stride) * FC_PACKET_BYTES};
    const bool valid[2] = {true, i + stride < npk};
    uint2 mine[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (valid[u]) {
        mine[u] = fc_load_payload(in, i + u * stride, nbytes);
        for (u32 j = 0; j < npush; ++j) fc_store_packet(t->ll_push[h][j] + off[u], mine[u].x, epoch, mine[u].y, epoch);
      }
    }
    float acc[2][P::N];
    fc_gather_sum<D, 2>(t, h, off, valid, epoch, mine, FC_STEP_ONE_SHOT, acc);
#pragma unroll
    for (int u = 0; u < 2; ++u)
      if (valid[u]) fc_store_payload(out, i + u * stride, nbytes, P::pack(acc[u]));
  }
  fc_end(t, epoch);
}
