"""The island two-shot's data flow on the CPU: csrc/comm/two_shot_islands.cuh's four phases, step for step, over
the peer tables fastcomm.layout builds and the cut ops launches (policy.two_shot_launch for the island's
size), in emulated memory. It checks what the kernel cannot check for itself without a GPU: that every
pointer it follows lands in its own group's region, in the slot its reader reads, that the slots hold every
cut, and that the phases in this order give the island rule's sum (the GPU test's reference) bit for bit.
A model of the kernel, not the kernel: tests/gpu/test_allreduce_gpu.py::test_two_shot_islands runs that.
"""
import pytest
import torch

from fastcomm import abi
from fastcomm import layout as L
from fastcomm.policy import two_shot_launch

MB = 1 << 20
OFF_MASK = (1 << 40) - 1


class _Memory:
    """Every rank's shared buffer; rank r's at (r + 1) << 40, as the layout tests map them."""

    def __init__(self, lay, world):
        self.bufs = [bytearray(lay.shared_bytes) for _ in range(world)]
        self.bases = [(r + 1) << 40 for r in range(world)]

    def view(self, addr, count, dtype, region):
        rank, off = (addr >> 40) - 1, addr & OFF_MASK
        nbytes = count * torch.tensor([], dtype=dtype).element_size()
        assert region[0] <= off and off + nbytes <= region[1], "outside the group's region"
        if count == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self.bufs[rank], dtype=dtype, count=count, offset=off)


def _chunk_count(n, seg, chunk, s, b):  # fc_chunk_count
    seg_len = max(0, min(seg, n - s * seg))
    return max(0, min(chunk, seg_len - b * chunk))


def _sum(terms, dtype):
    acc = terms[0].float()
    for t in terms[1:]:
        acc = acc + t.float()
    return acc.to(dtype)


def _emulate(lay, mem, islands, xs, call):
    world, size = len(xs), len(islands[0])
    dtype, n = xs[0].dtype, xs[0].numel()
    es = xs[0].element_size()
    lc = two_shot_launch(n, es, size, abi.MAX_BLOCKS)
    seg, chunk = lc.seg, lc.chunk
    h = call & 1  # both groups' epochs are `call` here (one call per group per step)
    groups = {r: L.groups_of(lay, r) for r in range(world)}
    t = {}
    for r in range(world):
        gi, gp = groups[r][1], groups[r][2]
        t[r] = [(g, L.build_table(lay, g, r, own_base=mem.bases[r], peer_bases=mem.bases, host_base=None,
                                  state_ptr=0, err_ptr=0, timeout_ns=1)) for g in (gi, gp)]
    rs = lambda g: (g.rs_off, g.ag_off)  # noqa: E731
    ag = lambda g: (g.ag_off, g.rs_flag_off)  # noqa: E731
    outs = [torch.full((n,), float("nan"), dtype=dtype) for _ in range(world)]

    def reduce_push(r, terms, lo, c, b, tab, grp):  # fc_ts_reduce_push: into out and to tab's destinations
        res = _sum(terms, dtype)
        outs[r][lo:lo + c] = res
        for j in range(tab.n_ag_push):
            mem.view(tab.ag_push[h][j] + b * chunk * es, c, dtype, ag(grp))[:] = res

    for b in range(lc.grid):  # 1. island reduce-scatter, send
        for r in range(world):
            (gi, ti), _ = t[r]
            for s in range(size):
                c = _chunk_count(n, seg, chunk, s, b)
                if s != ti.rank:
                    mem.view(ti.rs_push[h][s] + b * chunk * es, c, dtype, rs(gi))[:] = \
                        xs[r][s * seg + b * chunk:][:c]
    for b in range(lc.grid):  # 2. island partial, to out and the partners
        for r in range(world):
            (gi, ti), (gp, tp) = t[r]
            me, c = ti.rank, _chunk_count(n, seg, chunk, ti.rank, b)
            lo = me * seg + b * chunk
            terms = [xs[r][lo:lo + c] if p == me else mem.view(ti.rs_pull[h][p] + b * chunk * es, c, dtype, rs(gi))
                     for p in range(size)]
            reduce_push(r, terms, lo, c, b, tp, gp)
    for b in range(lc.grid):  # 3. across, in island order; to out and the island
        for r in range(world):
            (gi, ti), (gp, tp) = t[r]
            me, c = ti.rank, _chunk_count(n, seg, chunk, ti.rank, b)
            lo = me * seg + b * chunk
            terms = [outs[r][lo:lo + c].clone() if q == tp.rank else
                     mem.view(tp.ag_pull[h][q] + b * chunk * es, c, dtype, ag(gp)) for q in range(tp.world)]
            reduce_push(r, terms, lo, c, b, ti, gi)
    for b in range(lc.grid):  # 4. island all-gather, receive
        for r in range(world):
            (gi, ti), _ = t[r]
            for p in range(size):
                c = _chunk_count(n, seg, chunk, p, b)
                if p != ti.rank:
                    lo = p * seg + b * chunk
                    outs[r][lo:lo + c] = mem.view(ti.ag_pull[h][p] + b * chunk * es, c, dtype, ag(gi))
    return outs


SHAPES = [(4, ((0, 1), (2, 3))), (6, ((0, 1), (2, 3), (4, 5))), (6, ((0, 1, 2), (3, 4, 5))),
          (8, ((0, 1, 2, 3), (4, 5, 6, 7))), (8, ((0, 1), (2, 3), (4, 5), (6, 7))), (4, ((0, 2), (1, 3)))]


@pytest.mark.parametrize("world,islands", SHAPES)
def test_phases_give_the_island_rule_bit_for_bit(world, islands):
    max_bytes = 256 << 10
    lay = L.plan_layout("p2p", world, max_bytes, 64 << 10, islands)
    mem = _Memory(lay, world)
    g = torch.Generator().manual_seed(world)
    call = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        es = torch.tensor([], dtype=dtype).element_size()
        for n in (1, 3, 9, 17, 1000, 6147, 40961, max_bytes // es, max_bytes // es - 5):
            call += 1  # the halves alternate from call to call
            xs = [torch.randn(n, generator=g).to(dtype) for _ in range(world)]
            outs = _emulate(lay, mem, islands, xs, call)
            want = _sum([_sum([xs[r] for r in isl], dtype) for isl in islands], dtype)
            for r in range(world):
                assert torch.equal(outs[r], want), (dtype, n, r)
