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

  // One packet per thread per pass. (Two per pass, all loads in flight, measured slower on 2 x H200 at
  // every size: bench/results/2026-11-30-h200x2-run4-p2p.json.)
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < npk; i += (u64)gridDim.x * blockDim.x) {
    const u64 off[1] = {i * FC_PACKET_BYTES};
    const bool valid[1] = {true};
    const uint2 mine = fc_load_payload(in, i, nbytes);
    for (u32 j = 0; j < npush; ++j) fc_store_packet(t->ll_push[h][j] + off[0], mine.x, epoch, mine.y, epoch);
    float acc[1][P::N];
    fc_gather_sum<D, 1>(t, h, off, valid, epoch, &mine, FC_STEP_ONE_SHOT, acc);
    fc_store_payload(out, i, nbytes, P::pack(acc[0]));
  }
  fc_end(t, epoch);
}
