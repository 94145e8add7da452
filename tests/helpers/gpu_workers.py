"""Per-rank bodies of the GPU tests (run in spawned processes by fastcomm.spawn.run_ranks).

Each worker returns a dict of findings; assertions inside raise and are reported with the rank.
Outputs are poisoned (NaN) before each call so an unwritten element cannot pass. References come from
NCCL where every rank has its own GPU, and from the CPU (every rank's input gathered over gloo, summed in
float64) where ranks share GPUs, since NCCL refuses two ranks on one device. Integer-valued inputs make
both references exact.
"""
from __future__ import annotations

import glob

import torch
import torch.distributed as dist

import fastcomm
from fastcomm import FastcommError
from numerics import rmsnorm_ref, ulp_stats

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ODD_SIZES = (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 127, 1000, 4095, 6144, 6147, 65537, 100003)


def _ints(n, dtype, rank, seed, device):
    # Small integers keep every partial sum exact in bf16 (|sum| <= 64 < 256), so NCCL's ring order and
    # ours agree bit for bit.
    g = torch.Generator(device="cpu").manual_seed(seed * 131 + rank)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype=dtype, device=device)


def _poisoned(like):
    return torch.full_like(like, float("nan"))


_CPU_GROUP = None  # the gloo group the harness gives every body (set by each body on entry)


def _gather_cpu(t: torch.Tensor) -> list[torch.Tensor]:
    t = t.detach().contiguous().cpu()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(_CPU_GROUP))]
    dist.all_gather(out, t, group=_CPU_GROUP)
    return out


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    gathered = _gather_cpu(t.contiguous().view(torch.uint8).flatten())
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


_ISLANDS = None  # the workspace's islands (set by each body): the reference then follows the island rule


def _reduce_like_fastcomm(terms, dtype, islands="workspace"):
    """What fastcomm's all-reduce computes, bit for bit, from every rank's term (fp32 sums, the first term
    seeding each): flat, all ranks in rank order, rounded once to the dtype; with islands (the one-shot, the
    island two-shot and the fused op; ``islands`` defaults to the workspace's), each island's members in
    order rounded to the dtype (the partial that crosses), then the partials in island order, rounded
    again. The fused op's contract starts from the same value."""
    def ordered(ts):
        acc = ts[0].float()
        for t in ts[1:]:
            acc = acc + t.float()
        return acc

    islands = _ISLANDS if islands == "workspace" else islands
    if not islands:
        return ordered(terms).to(dtype)
    return ordered([ordered([terms[r] for r in isl]).to(dtype) for isl in islands]).to(dtype)


def _ordered_sum(x):
    return _reduce_like_fastcomm(_gather_cpu(x), x.dtype).to(x.device)


def _nccl_sum(x):
    """The reference sum: NCCL with one GPU per rank, else every rank's input summed on the CPU in float64
    (exact for the small integers the exact checks use, so it equals what NCCL would give)."""
    if dist.get_backend() == "nccl":
        y = x.clone()
        dist.all_reduce(y)
        return y
    return torch.stack([t.double() for t in _gather_cpu(x)]).sum(0).to(x.dtype).to(x.device)


def _exact_vs_nccl(ws, sizes, algos, seed):
    dev = ws.device
    checked = 0
    for dtype in DTYPES:
        for n in sizes:
            nbytes = n * torch.tensor([], dtype=dtype).element_size()
            for algo in algos:
                if ws.algo_for(nbytes, algo) is fastcomm.Algo.NCCL:
                    continue
                x = _ints(n, dtype, dist.get_rank(), seed + n, dev)
                keep = x.clone()
                out = _poisoned(x)
                fastcomm.all_reduce(x, ws, algo=algo, out=out)
                ref = _nccl_sum(x)
                assert torch.equal(out, ref), f"{algo} {dtype} n={n}: differs from NCCL ({(out != ref).sum()} elements)"
                assert torch.equal(x, keep), "input was modified"
                checked += 1
    return checked


def _random_vs_fp64(ws, seed):
    dev = ws.device
    rank, world = dist.get_rank(), dist.get_world_size()
    worst = {}
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)):
        for n in (5, 6144, 65536 + 3, 1 << 20):
            for algo in ("one_shot", "two_shot"):
                nbytes = n * torch.tensor([], dtype=dtype).element_size()
                if ws.algo_for(nbytes, algo) is fastcomm.Algo.NCCL:
                    continue
                g = torch.Generator(device="cpu").manual_seed(seed + n)
                xs = [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(world)]
                ref = sum(xs)
                x = xs[rank].to(dtype).to(dev)
                ref = sum(t.to(dtype).double() for t in xs)
                out = fastcomm.all_reduce(x, ws, algo=algo)
                err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
                assert err < tol, f"{algo} {dtype} n={n}: rel err {err}"
                assert _same_on_all_ranks(out), f"{algo} {dtype} n={n}: ranks disagree bitwise"
                worst[f"{algo}/{dtype}"] = max(err, worst.get(f"{algo}/{dtype}", 0.0))
    return worst


def _specials(ws, algos=("one_shot", "two_shot")):
    dev = ws.device
    rank = dist.get_rank()
    for algo in algos:
        for dtype in DTYPES:
            z = torch.full((1001,), -0.0, dtype=dtype, device=dev)
            out = fastcomm.all_reduce(z, ws, algo=algo)
            assert torch.equal(out, _nccl_sum(z)) and bool(torch.signbit(out).all()), f"{algo} {dtype}: -0.0 lost"
            zeros = torch.zeros(1001, dtype=dtype, device=dev)
            assert torch.equal(fastcomm.all_reduce(zeros, ws, algo=algo), zeros)
            x = torch.ones(1001, dtype=dtype, device=dev)
            x[0] = float("nan") if rank == 0 else 1.0
            x[1] = float("inf")
            x[2] = float("inf") if rank == 0 else float("-inf")
            x[3] = float("-inf")
            out = fastcomm.all_reduce(x, ws, algo=algo)
            assert torch.isnan(out[0]) and torch.isposinf(out[1]) and torch.isnan(out[2]) and torch.isneginf(out[3]), \
                f"{algo} {dtype}: specials {out[:4].tolist()}"
            assert _same_on_all_ranks(out)
            # The one-shot's "not arrived" sentinel is the all-ones bit pattern (a NaN): an input that holds
            # it must still arrive, as a NaN, whether one rank or every rank sends it.
            raw = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
            ones = torch.tensor([-1], dtype=raw).view(dtype).to(dev)
            y = torch.ones(1001, dtype=dtype, device=dev)
            y[5] = ones[0]
            if rank == 0:
                y[6] = ones[0]
            out = fastcomm.all_reduce(y, ws, algo=algo)
            world = dist.get_world_size()
            assert torch.isnan(out[5]) and torch.isnan(out[6]) and bool((out[7:] == world).all()), \
                f"{algo} {dtype}: sentinel-valued input {out[4:8].tolist()}"


def _bad_inputs(ws):
    dev = ws.device
    msgs = []
    for bad in (torch.ones(16, dtype=torch.int32, device=dev), torch.ones(16, dtype=torch.float32),
                torch.ones(16, 2, dtype=torch.float32, device=dev).t(),
                torch.ones(17, dtype=torch.float32, device=dev)[1:],
                torch.ones(ws.config.max_bytes // 4 + 1, dtype=torch.float32, device=dev)):
        try:
            fastcomm.all_reduce(bad, ws)
        except FastcommError as e:
            msgs.append(str(e))
        else:
            raise AssertionError(f"bad input accepted: {bad.dtype} {tuple(bad.shape)} {bad.device}")
    return msgs


def _try_all_reduce(ws):
    """The routing entry point: None for what the policy declines, the same sum as all_reduce otherwise."""
    dev = ws.device
    declined = [torch.ones(16, dtype=torch.int32, device=dev), torch.ones(16, dtype=torch.float32),
                torch.ones(17, dtype=torch.float32, device=dev)[1:],
                torch.ones(ws.config.max_bytes // 4 + 1, dtype=torch.float32, device=dev)]
    assert all(fastcomm.try_all_reduce(x, ws) is None for x in declined)
    served = 0
    for n in (0, 1, 6144, 3 * 6144 + 5):
        x = _ints(n, torch.bfloat16, ws.rank, 9, dev)
        got = fastcomm.try_all_reduce(x, ws)
        assert got is not None and torch.equal(got, _nccl_sum(x)), n
        served += 1
    return served


_BACK_TO_BACK = ((1, "one_shot"), (6144, "one_shot"), (6144, "two_shot"), (100003, "two_shot"), (12345, "one_shot"),
                 (262144, "two_shot"), (3, "two_shot"), (65536, "one_shot"))


def _back_to_back(ws, calls, plan=_BACK_TO_BACK):
    """Many calls, alternating sizes and algorithms, every result checked (inputs differ per call)."""
    dev = ws.device
    rank, world = dist.get_rank(), dist.get_world_size()
    base = {n: _ints(n, torch.bfloat16, 0, n, dev) for n, _ in plan}
    outs = {n: torch.empty(n, dtype=torch.bfloat16, device=dev) for n, _ in plan}
    bad = good = 0
    for i in range(calls):
        n, algo = plan[i % len(plan)]
        k = (i % 5) + 1  # x_r = base * (r+1) * k: sums up to 8 * 5 * 36, past bf16's exact integers at 8 ranks
        x = base[n] * ((rank + 1) * k)
        fastcomm.all_reduce(x, ws, algo=algo, out=outs[n])
        # Islands shape the one-shot family only; the two-shot is flat in every layout.
        want = _reduce_like_fastcomm([base[n] * ((r + 1) * k) for r in range(world)], torch.bfloat16,
                                     islands="workspace" if algo == "one_shot" else None)
        if not torch.equal(outs[n], want):
            bad += 1
        else:
            good += 1
    torch.cuda.synchronize()
    assert bad == 0, f"{bad} of {calls} back-to-back calls wrong"
    return good  # calls whose result was checked and right


def _graphs(ws, replays):
    """Capture twice (two graphs sharing the workspace), replay alternately with new inputs each time."""
    dev = ws.device
    rank, world = dist.get_rank(), dist.get_world_size()
    tri = world * (world + 1) // 2
    hidden = 6144
    a = torch.zeros(6144, dtype=torch.bfloat16, device=dev)
    b = torch.zeros(300001, dtype=torch.bfloat16, device=dev)
    x = torch.zeros(4, hidden, dtype=torch.bfloat16, device=dev)
    res = torch.zeros_like(x)
    w = torch.ones(hidden, dtype=torch.bfloat16, device=dev)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream())
    graphs = []
    with torch.cuda.stream(s):
        fastcomm.all_reduce(a, ws)  # warm-up (compile, module load) outside capture
        fastcomm.all_reduce(b, ws, algo="two_shot")
        fastcomm.fused_all_reduce_rmsnorm(x, w, 1e-5, ws, residual=res)
        for _ in range(2):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                oa = fastcomm.all_reduce(a, ws)
                ob = fastcomm.all_reduce(b, ws, algo="two_shot")
                of, ro = fastcomm.fused_all_reduce_rmsnorm(x, w, 1e-5, ws, residual=res)
            graphs.append((g, oa, ob, of, ro))
    torch.cuda.current_stream().wait_stream(s)
    ar = torch.arange(6144, device=dev)
    br = torch.arange(300001, device=dev)
    checked = 0
    for i in range(replays):
        v = (i % 7) - 3
        a.copy_(((ar + i) % 5 - 2).to(torch.bfloat16) * (rank + 1))
        b.copy_(((br + i) % 3 - 1).to(torch.bfloat16) * (rank + 1))
        x.copy_(((torch.arange(4 * hidden, device=dev).view(4, hidden) + i) % 7 - 3).to(torch.bfloat16))
        res.fill_(v)
        g, oa, ob, of, ro = graphs[i % 2]
        g.replay()
        # Every replay is checked (inputs changed before each).
        assert torch.equal(oa, (((ar + i) % 5 - 2) * tri).to(torch.bfloat16)), f"replay {i}: one-shot wrong"
        assert torch.equal(ob, (((br + i) % 3 - 1) * tri).to(torch.bfloat16)), f"replay {i}: two-shot wrong"
        ref = (((torch.arange(4 * hidden, device=dev).view(4, hidden) + i) % 7 - 3) * world + v).to(torch.bfloat16)
        assert torch.equal(ro, ref), f"replay {i}: fused residual wrong"
        checked += 1
    torch.cuda.synchronize()
    return checked  # replays whose three results were checked and right


def _fused(ws, seed):
    dev = ws.device
    rank = dist.get_rank()
    worst = 0.0
    for dtype in DTYPES:
        for tokens, hidden in ((1, 6144), (3, 6144), (8, 4099), (64, 6144), (2, 16384), (5, 7), (1, 1)):
            # The kernel is tested over its whole reach, not only the plan's routing range.
            if not ws.can_fuse(torch.empty(tokens, hidden, dtype=dtype, device=dev), within_policy=False):
                continue
            g = torch.Generator(device="cpu").manual_seed(seed + tokens * hidden)
            x = torch.randn(tokens, hidden, generator=g).to(dtype).to(dev) * (rank + 1)
            resid = torch.randn(tokens, hidden, generator=g).to(dtype).to(dev)
            w = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(dev)
            for with_res in (True, False):
                r = resid.clone() if with_res else None
                out, rout = fastcomm.fused_all_reduce_rmsnorm(x, w, 1e-5, ws, residual=r)
                ar = _ordered_sum(x)
                ref_out, ref_z = rmsnorm_ref(ar, r, w, 1e-5)
                assert torch.equal(rout, ref_z), f"fused {dtype} {tokens}x{hidden}: residual_out differs"
                # Same rounding steps as the reference; only the sum of squares is added in another order, so
                # inv_rms may differ in its last fp32 bit: a rare one-ulp output difference, no more.
                # (fp32 keeps every bit of that difference, so it gets a loose bound and no exact share.)
                err, exact = ulp_stats(out, ref_out)
                bound, share = {torch.bfloat16: (1.0, 0.99), torch.float16: (1.0, 0.97),
                                torch.float32: (64.0, 0.0)}[dtype]
                assert err <= bound, f"fused {dtype} {tokens}x{hidden} res={with_res}: {err} ulps"
                if out.numel() >= 1000:
                    assert exact >= share, f"fused {dtype} {tokens}x{hidden} res={with_res}: only {exact:.4f} exact"
                assert _same_on_all_ranks(out) and _same_on_all_ranks(rout)
                worst = max(worst, err)
            # in place, as vLLM calls it: out into x, residual_out into residual
            xi, ri = x.clone(), resid.clone()
            ref_out, ref_z = rmsnorm_ref(_ordered_sum(x), resid, w, 1e-5)
            fastcomm.fused_all_reduce_rmsnorm(xi, w, 1e-5, ws, residual=ri, out=xi, residual_out=ri)
            assert torch.equal(ri, ref_z), "in-place fused: residual differs"
    return worst


def _bits_match(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (so -0.0 is not 0.0), except that any NaN matches any NaN: the CPU and the GPU make
    NaNs with different payloads."""
    raw = {2: torch.int16, 4: torch.int32}[a.element_size()]
    same = a.contiguous().view(raw) == b.contiguous().view(raw)
    return bool((same | (torch.isnan(a) & torch.isnan(b))).all())


_FUSED_BOUNDS = {torch.bfloat16: (1.0, 0.99), torch.float16: (1.0, 0.97), torch.float32: (64.0, 0.0)}


def _check_fused_result(what, out, rout, ref_out, ref_z):
    """residual_out bit for bit; out within the one-ulp sum-of-squares order allowance (see _fused); both
    identical on every rank."""
    assert torch.equal(rout, ref_z), f"{what}: residual_out differs"
    err, exact = ulp_stats(out, ref_out)
    bound, share = _FUSED_BOUNDS[out.dtype]
    assert err <= bound, f"{what}: {err} ulps"
    if out.numel() >= 1000:
        assert exact >= share, f"{what}: only {exact:.4f} exact"
    assert _same_on_all_ranks(out) and _same_on_all_ranks(rout), f"{what}: ranks differ"
    return err


def _fused_two_shot_specials(ws, dtype, algo="two_shot"):
    """-0.0, +-inf, NaN and the sentinel's bit pattern through fused_two_shot. Rows 0-2 give inv_rms values
    whose use is exact (z = -0, inv = 0, NaN), so their outputs must be the reference's bits; row 3 is
    ordinary (rsqrtf: the usual ulp allowance)."""
    dev, rank = ws.device, dist.get_rank()
    raw = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    x = torch.ones(4, 1000, dtype=dtype, device=dev)
    x[0] = -0.0                                  # a row of -0.0: z = -0, out = -0
    x[1, 4], x[1, 7] = float("inf"), float("-inf")  # ss = inf: inv = 0, out = +-0 and NaN at the infs
    x[2, 3] = float("nan") if rank == 0 else 1.0
    x[2, 5] = float("inf") if rank == 0 else float("-inf")
    if rank == 0:
        x[2, 6] = torch.tensor([-1], dtype=raw).view(dtype)[0]  # the "not arrived" pattern, sent as a NaN
    w = torch.ones(1000, dtype=dtype, device=dev)
    ar = _ordered_sum(x)
    for r in (None, torch.cat([torch.full((1, 1000), -0.0), torch.full((3, 1000), 0.5)]).to(dtype).to(dev)):
        out, rout = fastcomm.fused_all_reduce_rmsnorm(x, w, 1e-5, ws, residual=r, algo=algo)
        ref_out, ref_z = rmsnorm_ref(ar, r, w, 1e-5)
        what = f"fused {algo} {dtype} specials (residual {r is not None})"
        assert _bits_match(rout, ref_z) and _bits_match(out[:3], ref_out[:3]), \
            f"{what}: {out[:3, :8].tolist()} against {ref_out[:3, :8].tolist()}"
        assert ulp_stats(out[3], ref_out[3])[0] <= _FUSED_BOUNDS[dtype][0], what
        assert bool(torch.signbit(out[0]).all()) and bool(torch.isnan(out[2]).all())
        assert _same_on_all_ranks(out) and _same_on_all_ranks(rout)


def _fused_graph(ws, replays, inputs, calls):
    """One graph holding a one-shot all-reduce and the fused ``calls`` (x, residual, weight, algo, label; x
    and residual may be views of the ``inputs`` pairs, which are refilled), replayed with new small-integer
    inputs each time (every sum exact), every result checked; the kernels share the Lamport buffers'
    rotation and clears. Returns the replays checked."""
    dev = ws.device
    rank, world = dist.get_rank(), dist.get_world_size()
    a = torch.zeros(6144, dtype=torch.bfloat16, device=dev)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fastcomm.all_reduce(a, ws, algo="one_shot")
        for x, r, w, algo, _ in calls:
            fastcomm.fused_all_reduce_rmsnorm(x, w, 1e-5, ws, residual=r, algo=algo)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            oa = fastcomm.all_reduce(a, ws, algo="one_shot")
            outs = [fastcomm.fused_all_reduce_rmsnorm(x, w, 1e-5, ws, residual=r, algo=algo)
                    for x, r, w, algo, _ in calls]
    torch.cuda.current_stream().wait_stream(s)
    ar = torch.arange(6144, device=dev)
    checked = 0
    for i in range(replays):
        a.copy_(((ar + i) % 5 - 2).to(torch.bfloat16) * (rank + 1))
        for x, r in inputs:
            grid = torch.arange(x.numel(), device=dev).view_as(x)
            x.copy_(((grid * (i + 1)) % 7 - 3).to(torch.bfloat16))
            r.copy_(((grid + i) % 5 - 2).to(torch.bfloat16))
        g.replay()
        torch.cuda.current_stream().synchronize()
        assert torch.equal(oa, (((ar + i) % 5 - 2) * (world * (world + 1) // 2)).to(torch.bfloat16)), f"replay {i}"
        for (o, ro), (x, r, w, _, label) in zip(outs, calls):
            ref_out, ref_z = rmsnorm_ref((x.float() * world).to(torch.bfloat16), r, w, 1e-5)
            _check_fused_result(f"graph replay {i} ({label})", o, ro, ref_out, ref_z)
        checked += 1
    return checked


def _fused_two_shot_graph(ws, replays):
    """The one-shot fused op and the two-shot one in one graph (8 x 6144, its first 2 rows one-shot)."""
    hidden = 6144
    x = torch.zeros(8, hidden, dtype=torch.bfloat16, device=ws.device)
    res = torch.zeros_like(x)
    w = (torch.arange(hidden, device=ws.device) % 3 + 1).to(torch.bfloat16)
    return _fused_graph(ws, replays, [(x, res)], [(x[:2], res[:2], w, "one_shot", "one-shot"),
                                                  (x, res, w, "two_shot", "two-shot")])


def _fused_modes(ws, found, rank, dtype, tokens, hidden, seed, label, algo):
    """One shape of the fused op forced to ``algo``, with a residual, without, and in place, each against the
    CPU reference of the rounding contract (rmsnorm_ref over the rank-ordered sum); counts into ``found``."""
    dev = ws.device
    g = torch.Generator(device="cpu").manual_seed(tokens * hidden + seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(dev) * (rank + 1)
    resid = torch.randn(tokens, hidden, generator=g).to(dtype).to(dev)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(dev)
    x_before = x.clone()
    ar = _ordered_sum(x)
    for mode in ("residual", "no residual", "in place"):
        what = f"{label} {dtype} {tokens}x{hidden} {mode}"
        r = None if mode == "no residual" else resid.clone()
        if mode == "in place":
            xi = x.clone()
            out, rout = fastcomm.fused_all_reduce_rmsnorm(xi, w, 1e-5, ws, residual=r, out=xi, residual_out=r,
                                                          algo=algo)
            assert out.data_ptr() == xi.data_ptr() and rout.data_ptr() == r.data_ptr()
        else:
            out, rout = _poisoned(x), _poisoned(x)
            fastcomm.fused_all_reduce_rmsnorm(x, w, 1e-5, ws, residual=r, out=out, residual_out=rout, algo=algo)
            assert torch.equal(x, x_before) and (r is None or torch.equal(r, resid)), f"{what}: input changed"
        ref_out, ref_z = rmsnorm_ref(ar, None if mode == "no residual" else resid, w, 1e-5)
        found["worst_ulps"] = max(found["worst_ulps"], _check_fused_result(what, out, rout, ref_out, ref_z))
        found["checked"] += 1


def _fused_sweep(ws, found, rank, shapes, seed, label, algo, on_shape=None):
    """Every dtype x (tokens, hidden) of ``shapes`` that the fused kernel of ``algo`` takes (outside the
    policy's range too): _fused_modes against the CPU reference, then the specials; shapes it refuses are
    listed in found["skipped"]. ``on_shape(x)`` runs first for each shape taken."""
    for dtype in DTYPES:
        for tokens, hidden in shapes:
            x = torch.empty(tokens, hidden, dtype=dtype, device=ws.device)
            kernel, why = ws.fused_route(x, within_policy=False, algo=algo)
            if kernel is None:
                found["skipped"].append(f"{dtype} {tokens}x{hidden}: {why}")
                continue
            if on_shape is not None:
                on_shape(x)
            _fused_modes(ws, found, rank, dtype, tokens, hidden, seed, label, algo)
        _fused_two_shot_specials(ws, dtype, algo=algo)
        found["checked"] += 2


def fused_two_shot(rank, world, gloo, transport, replays):
    """fused_two_shot.cuh against the CPU reference of the fused op's rounding contract (rmsnorm_ref over
    the rank-ordered sum, as _fused), and bit for bit across ranks: tokens 1-64 x hidden 6144, 7168, 1000
    and 1001 (rows not 16-byte aligned), every dtype, with and without a residual, in place, specials, the
    policy's choice of kernel, and graph replays. The same residual on every rank, as vLLM's."""
    global _CPU_GROUP, _ISLANDS
    _CPU_GROUP, _ISLANDS = gloo, None
    # One-shot buffers of 2.5 MiB: the host transport's slots hold every part of the message (64 x 6144 fp32
    # at 2 ranks: 2.25 MiB); a small two-shot region keeps the host segment below the core test's.
    with fastcomm.Workspace(gloo, transport=transport, max_bytes=5 << 19, one_shot_max_bytes=5 << 19) as ws:
        dev = ws.device
        found = {"describe": ws.describe(), "checked": 0, "skipped": [], "worst_ulps": 0.0}
        shapes = [(t, h) for h in (6144, 1000) for t in (1, 2, 3, 8, 17, 64)] + [(3, 7168), (1, 1001), (17, 1001)]
        _fused_sweep(ws, found, rank, shapes, 11, "fused two-shot", "two_shot")
        # The policy's choice, as the vLLM plugin sees it (ws.why_not_fused / can_fuse, within the policy).
        found["route"] = {}
        for t in (1, 2, 8, 64, 65):
            kernel = ws.fused_route(torch.empty(t, 6144, dtype=torch.bfloat16, device=dev))[0]
            found["route"][t] = None if kernel is None else kernel.value
        auto_x = torch.full((8, 6144), 1.0, dtype=torch.bfloat16, device=dev)
        out, rout = fastcomm.fused_all_reduce_rmsnorm(auto_x, torch.ones(6144, dtype=torch.bfloat16, device=dev),
                                                      1e-5, ws)
        assert torch.equal(rout, torch.full_like(auto_x, world)) and torch.equal(out, torch.ones_like(auto_x))
        found["graph_replays"] = _fused_two_shot_graph(ws, replays)
        torch.cuda.synchronize()
    return found


def _fused_cluster_graph(ws, replays):
    """The cluster fused op in one graph at 8 x 6144 and 3 x 1001 (a row not 16-byte aligned: vectors
    straddle rows)."""
    dev = ws.device
    xs = [torch.zeros(t, h, dtype=torch.bfloat16, device=dev) for t, h in ((8, 6144), (3, 1001))]
    inputs = [(x, torch.zeros_like(x)) for x in xs]
    calls = [(x, r, (torch.arange(x.shape[1], device=dev) % 3 + 1).to(torch.bfloat16), "one_shot",
              f"cluster {tuple(x.shape)}") for x, r in inputs]
    return _fused_graph(ws, replays, inputs, calls)


def fused_cluster(rank, world, gloo, transport, replays):
    """fused_cluster.cuh (FASTCOMM_FUSED_CLUSTER=on: one thread-block cluster per row) against the fused
    op's rounding contract (rmsnorm_ref over the rank-ordered sum) and bit for bit across ranks: tokens 1-8
    x 6144 and odd rows, every dtype, with and without a residual, in place, specials, graph replays."""
    global _CPU_GROUP, _ISLANDS
    _CPU_GROUP, _ISLANDS = gloo, None
    from fastcomm import abi
    from fastcomm.policy.launch import fused_cluster_launch
    from fastcomm.workspace import dtype_name

    with fastcomm.Workspace(gloo, transport=transport, max_bytes=1 << 20, one_shot_max_bytes=1 << 20,
                            fused_cluster="on") as ws:
        assert ws.plan.fused_cluster, "FASTCOMM_FUSED_CLUSTER=on did not choose the cluster form"
        found = {"describe": ws.describe(), "checked": 0, "cluster_launches": 0, "skipped": [], "worst_ulps": 0.0}
        shapes = [(t, 6144) for t in range(1, 9)] + [(3, 4099), (5, 7), (2, 1001), (1, 1), (2, 16384)]

        def count_cluster_launch(x):
            # The launch ops makes: one cluster of the shape must fit, else ops falls back (counted here).
            lc = fused_cluster_launch(x.shape[0], x.shape[1], x.element_size(), ws.plan.max_blocks)
            fn = ws.function(abi.FUSED_CLUSTER, dtype_name(x.dtype))
            found["cluster_launches"] += ws.resident_clusters(fn, lc.block, lc.splits) >= 1

        _fused_sweep(ws, found, rank, shapes, 5, "fused cluster", "one_shot", count_cluster_launch)
        found["graph_replays"] = _fused_cluster_graph(ws, replays)
        torch.cuda.synchronize()
    return found


def core(rank, world, gloo, transport, islands, calls, replays):
    global _CPU_GROUP, _ISLANDS
    _CPU_GROUP = gloo
    kw = dict(transport=transport, max_bytes=8 << 20, one_shot_max_bytes=1 << 20)
    if islands:
        kw["islands"] = islands
    with fastcomm.Workspace(gloo, **kw) as ws:
        _ISLANDS = ws.islands
        found = {"describe": ws.describe()}
        found["exact"] = _exact_vs_nccl(ws, ODD_SIZES + (1 << 19, (8 << 20) // 4), ("one_shot", "two_shot"), 1)
        found["full_range"] = _exact_vs_nccl(ws, ((8 << 20) // 2,), ("two_shot", "auto"), 2)
        found["random_worst_rel_err"] = _random_vs_fp64(ws, 3)
        _specials(ws)
        found["bad_input_messages"] = _bad_inputs(ws)
        found["try_all_reduce"] = _try_all_reduce(ws)
        found["back_to_back"] = _back_to_back(ws, calls)
        found["graph_replays"] = _graphs(ws, replays)
        found["fused_worst_ulps"] = _fused(ws, 4)
        torch.cuda.synchronize()
    return found


# Element counts for the two-shot family: tails of every length, segments shorter than a vector, empty
# segments (fewer elements than ranks), several blocks.
TWO_SHOT_SIZES = (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 127, 1000, 4095, 6144, 6147, 40961, 65537, 100003)
# Every user of the Lamport slots (one-shot, Lamport two-shot) and the flagged two-shot, interleaved, sizes
# within what 256 KiB slots hold at any world size and transport (host, 2 ranks: 170 KiB).
_LL_BACK_TO_BACK = ((1, "two_shot_ll"), (6144, "one_shot"), (6144, "two_shot_ll"), (77777, "two_shot_ll"),
                    (3, "two_shot"), (12345, "two_shot_ll"), (65536, "one_shot"), (100003, "two_shot"),
                    (7, "two_shot_ll"), (40961, "two_shot"))


def _ll_graphs(ws, replays):
    """One graph holding a one-shot, two Lamport two-shots (one in place) and a two-shot, replayed with new
    inputs before every replay; every output checked."""
    dev = ws.device
    rank, world = dist.get_rank(), dist.get_world_size()
    tri = world * (world + 1) // 2
    sizes = {"a": 6144, "b": 40001, "c": 9, "d": 300001}
    bufs = {k: torch.zeros(n, dtype=torch.bfloat16, device=dev) for k, n in sizes.items()}
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream())

    def body():
        oa = fastcomm.all_reduce(bufs["a"], ws, algo="one_shot")
        ob = fastcomm.all_reduce(bufs["b"], ws, algo="two_shot_ll")
        oc = fastcomm.all_reduce(bufs["c"], ws, algo="two_shot_ll", out=bufs["c"])
        od = fastcomm.all_reduce(bufs["d"], ws, algo="two_shot")
        return {"a": oa, "b": ob, "c": oc, "d": od}

    with torch.cuda.stream(s):
        body()  # warm-up outside capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            outs = body()
    torch.cuda.current_stream().wait_stream(s)
    ramps = {k: torch.arange(n, device=dev) for k, n in sizes.items()}
    checked = 0
    for i in range(replays):
        for k, b in bufs.items():
            b.copy_((((ramps[k] + i) % 7) - 3).to(torch.bfloat16) * (rank + 1))
        g.replay()
        for k, o in outs.items():
            want = ((((ramps[k] + i) % 7) - 3) * tri).to(torch.bfloat16)
            assert torch.equal(o, want), f"replay {i}: {k} wrong"
        checked += 1
    torch.cuda.synchronize()
    return checked


def two_shot_variants(rank, world, gloo, transport, calls, replays):
    """The two-shot (its body specialised per world size) and the Lamport two-shot at one world size: exact
    sums over odd sizes and every dtype; random data bitwise equal to the rank-order fp32 sum on every rank
    (and the Lamport two-shot to the one-shot, same terms, same order); -0.0 / NaN / inf and the sentinel
    pattern; in place; its size limit; calls of every slot user interleaved; graph replays."""
    global _CPU_GROUP, _ISLANDS
    _CPU_GROUP, _ISLANDS = gloo, None
    with fastcomm.Workspace(gloo, transport=transport, max_bytes=2 << 20, one_shot_max_bytes=256 << 10) as ws:
        dev = ws.device
        cap = ws.plan.two_shot_ll_max_bytes
        found = {"describe": ws.describe(), "two_shot_ll_max_bytes": cap}
        found["exact"] = _exact_vs_nccl(ws, TWO_SHOT_SIZES + (cap // 2, cap // 4), ("two_shot", "two_shot_ll"), 11)
        random_checked = 0
        for dtype in DTYPES:
            for n in (5, 4097, 65537, cap // torch.tensor([], dtype=dtype).element_size()):
                g = torch.Generator(device="cpu").manual_seed(17 * n + rank)
                x = torch.randn(n, generator=g).to(dtype).to(dev)
                want = _ordered_sum(x)
                for algo in ("two_shot", "two_shot_ll", "one_shot"):
                    if ws.algo_for(n * x.element_size(), algo) is fastcomm.Algo.NCCL:
                        continue
                    out = fastcomm.all_reduce(x, ws, algo=algo)
                    assert torch.equal(out, want), f"{algo} {dtype} n={n}: not the rank-order fp32 sum"
                    random_checked += 1
        found["random_bitwise"] = random_checked
        _specials(ws, ("two_shot", "two_shot_ll"))
        for n in (3, 6147, 65537):  # in place
            x = _ints(n, torch.bfloat16, rank, 21 + n, dev)
            want = _nccl_sum(x)
            for algo in ("two_shot", "two_shot_ll"):
                y = x.clone()
                fastcomm.all_reduce(y, ws, algo=algo, out=y)
                assert torch.equal(y, want), f"{algo} in place n={n}"
        too_big = torch.ones(cap // 2 + 8, dtype=torch.bfloat16, device=dev)
        assert ws.algo_for(too_big.numel() * 2, "two_shot_ll") is fastcomm.Algo.NCCL
        try:
            fastcomm.all_reduce(too_big, ws, algo="two_shot_ll")
        except FastcommError:
            pass
        else:
            raise AssertionError("two_shot_ll accepted a message larger than its slots")
        found["interleaved"] = _back_to_back(ws, calls, _LL_BACK_TO_BACK)
        found["graph_replays"] = _ll_graphs(ws, replays)
        torch.cuda.synchronize()
    return found


def timeout(rank, world, gloo, transport, die, timeout_s=3.0, report_dir=None, algo="auto", islands=None):
    """Rank world-1 skips (or dies before) the second call; the others must error out, not hang.
    ``algo``: forced for both calls (default: the policy's choice for 12 KB, the one-shot); ``islands``: the
    workspace's, if any.

    Each waiting rank reports when its device-side error record appeared (watched from the host: the record
    is pinned memory) and, separately, when CUDA's synchronize returned: with ranks sharing a GPU the two can
    differ, and the record is what fastcomm controls.
    """
    import math
    import os
    import threading
    import time

    global _CPU_GROUP
    _CPU_GROUP = gloo
    ws = fastcomm.Workspace(gloo, transport=transport, timeout_s=timeout_s, max_bytes=1 << 20,
                            **({"islands": islands} if islands else {}))
    x = torch.ones(6144, dtype=torch.bfloat16, device=ws.device)
    fastcomm.all_reduce(x, ws, algo=algo)
    torch.cuda.synchronize()
    dist.barrier(group=gloo)
    if rank == world - 1:
        if die:
            os._exit(3)
        time.sleep(timeout_s + 8)  # stay alive (buffers mapped) while the others time out
        return {"skipped": True}
    seen = {}

    def say(what):  # straight to the log: a rank that never returns still shows how far it got
        print(f"[timeout test] world {world} {transport} die={die} rank {rank}: {what} at "
              f"{time.monotonic() - t0:.2f} s", flush=True)

    def report(**found):
        # A file as well as the return value: with ranks sharing a GPU, a process whose CUDA context is
        # still being torn down may never get to return, but what fastcomm reported is already here.
        if report_dir is not None:
            import json

            with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
                json.dump(found, f)

    def on_record(msg):
        seen.setdefault("t", time.monotonic())
        say("error record set")
        report(message=msg, record_s=seen["t"] - t0, sync_returned=False)

    import faulthandler

    faulthandler.dump_traceback_later(timeout_s + 30, exit=False)  # where a rank still stuck then is stuck
    t0 = time.monotonic()
    ws.watch(on_record)
    fastcomm.all_reduce(x, ws, algo=algo)
    say("launched")
    done, out = threading.Event(), {}

    def sync():
        try:
            torch.cuda.synchronize()
        except Exception as e:  # the trap surfaces here as CUDA's generic launch failure
            out["cuda_error"] = f"{type(e).__name__}: {e}"[:300]
            out["t"] = time.monotonic()
        done.set()

    threading.Thread(target=sync, daemon=True).start()
    done.wait(timeout_s + 20)
    say("sync returned" if done.is_set() else "sync still waiting")
    while "t" not in seen and time.monotonic() < t0 + timeout_s + 20:
        time.sleep(0.01)
    translated = fastcomm.translate_error(RuntimeError(out.get("cuda_error", "")))
    say("returning")
    faulthandler.cancel_dump_traceback_later()
    found = {"message": ws.error_message(), "record_s": seen.get("t", math.inf) - t0,
             "sync_s": out.get("t", math.inf) - t0, "sync_returned": done.is_set(),
             "cuda_error": out.get("cuda_error"), "translated": None if translated is None else str(translated),
             "shm_leftovers": glob.glob("/dev/shm/fastcomm-*")}
    report(**found)
    return found


def p2p_check(rank, world, gloo, transport, broken):
    """Build a workspace with the P2P check on, optionally with one pair's check writes dropped
    (FASTCOMM_TEST_BREAK_P2P, set by the test), and report what was chosen (and the check's cost)."""
    global _CPU_GROUP
    _CPU_GROUP = gloo
    try:
        ws = fastcomm.Workspace(gloo, transport=transport)
    except FastcommError as e:
        return {"error": str(e)}
    with ws:
        x = _ints(6144, torch.bfloat16, rank, 5, ws.device)
        ok = torch.equal(fastcomm.all_reduce(x, ws), _nccl_sum(x))
        return {"transport": ws.transport.value, "describe": ws.describe(), "sum_ok": ok}


# The pull's checks: byte sizes from 4 KB to 8 MB (both stages where the world has two: the switch is at
# 512 KB up to 4 ranks and 256 KB above, fastcomm.policy.pull_stages), each as a whole and an odd element count.
PULL_SIZES = (4 << 10, 12 << 10, 100 << 10, 256 << 10, 300 << 10, 512 << 10, 768 << 10, 1 << 20, 3 << 20, 8 << 20)


def _pull_counts(dtype):
    """Element counts: two tiny ones, then each size whole or 3 elements short (odd), alternating."""
    es = torch.tensor([], dtype=dtype).element_size()
    return (1, 7) + tuple(s // es - (3 if i % 2 else 0) for i, s in enumerate(PULL_SIZES))


def pull(rank, world, gloo, replays):
    """The pull (forced per call), every result checked: exact integer sums against the reference, random
    data bitwise against fastcomm's own order (rank order, fp32, one rounding) and across ranks, in place,
    specials, bursts interleaved with the other algorithms (the epoch halves across kernels), and a
    captured graph replayed with new inputs. At 2 ranks also: the host transport refuses the pull."""
    global _CPU_GROUP, _ISLANDS
    _CPU_GROUP, _ISLANDS = gloo, None
    found = {}
    with fastcomm.Workspace(gloo, transport="p2p", max_bytes=8 << 20, one_shot_max_bytes=256 << 10) as ws:
        dev = ws.device
        found["describe"] = ws.describe()
        found["stages"] = sorted({fastcomm.policy.pull_stages(n * torch.tensor([], dtype=d).element_size(), world)
                                  for d in DTYPES for n in _pull_counts(d)})
        exact = rnd = 0
        for dtype in DTYPES:
            for n in _pull_counts(dtype):
                x = _ints(n, dtype, rank, 17 + n, dev)
                keep = x.clone()
                out = _poisoned(x)
                fastcomm.all_reduce(x, ws, algo="pull", out=out)
                ref = _nccl_sum(x)
                assert torch.equal(out, ref), f"pull {dtype} n={n}: {(out != ref).sum().item()} elements differ"
                assert torch.equal(x, keep), f"pull {dtype} n={n}: input modified"
                exact += 1
            for n in (6147, (300 << 10) // 2 + 5, (1 << 20) + 3):
                g = torch.Generator(device="cpu").manual_seed(29 + n)
                terms = [torch.randn(n, generator=g).to(dtype) for _ in range(world)]
                out = fastcomm.all_reduce(terms[rank].to(dev), ws, algo="pull")
                want = _reduce_like_fastcomm(terms, dtype, islands=None)
                assert torch.equal(out.cpu(), want), f"pull {dtype} n={n}: random data not bitwise fastcomm's order"
                assert _same_on_all_ranks(out), f"pull {dtype} n={n}: ranks disagree bitwise"
                rnd += 1
            for n in (3, (600 << 10) // 2 + 1):  # in place: out is x
                x = _ints(n, dtype, rank, 41 + n, dev)
                ref = _nccl_sum(x)
                fastcomm.all_reduce(x, ws, algo="pull", out=x)
                assert torch.equal(x, ref), f"pull in place {dtype} n={n}"
        found["exact"], found["random_bitwise"] = exact, rnd
        _specials(ws, ("pull",))
        found["interleaved"] = _pull_bursts(ws)
        found["graph_replays"] = _pull_graph(ws, replays)
        torch.cuda.synchronize()
    if world == 2:
        with fastcomm.Workspace(gloo, transport="host", max_bytes=1 << 20) as hws:
            x = torch.ones(4096, dtype=torch.bfloat16, device=hws.device)
            try:
                fastcomm.all_reduce(x, hws, algo="pull")
            except FastcommError as e:
                found["host_refusal"] = str(e)
        try:
            fastcomm.Workspace(gloo, transport="host", algo="pull", max_bytes=1 << 20).close()
        except FastcommError as e:
            found["host_build_refusal"] = str(e)
    return found


def _pull_bursts(ws):
    """Calls issued back to back without a sync (pull, one-shot, two-shot on the same group), checked after
    each burst: the pull's two halves are reused only under the argument in pull.cuh."""
    dev = ws.device
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = [(300001, "pull"), (6144, "one_shot"), (300001, "pull"), (131075, "pull"), (100003, "two_shot"),
            (524288, "pull"), (3, "pull"), (65536, "one_shot")]
    base = {n: _ints(n, torch.bfloat16, 0, n, dev) for n, _ in plan}
    good = 0
    for burst in range(2):
        outs = []
        for i, (n, algo) in enumerate(plan * 2):
            k = (i + burst) % 5 + 1
            outs.append((n, k, fastcomm.all_reduce(base[n] * ((rank + 1) * k), ws, algo=algo)))
        torch.cuda.synchronize()
        for n, k, out in outs:
            want = _reduce_like_fastcomm([base[n] * ((r + 1) * k) for r in range(world)], torch.bfloat16, islands=None)
            assert torch.equal(out, want), f"burst {burst}: n={n} k={k} wrong"
            good += 1
    return good


def _pull_graph(ws, replays):
    """One graph with a pull of each stage this world has (and a one-shot between), replayed with new inputs."""
    dev = ws.device
    rank, world = dist.get_rank(), dist.get_world_size()
    tri = world * (world + 1) // 2
    a = torch.zeros(100003, dtype=torch.bfloat16, device=dev)   # ~200 KB: one stage at every world size
    b = torch.zeros(1500007, dtype=torch.bfloat16, device=dev)  # ~3 MB: two stages above 2 ranks
    c = torch.zeros(4099, dtype=torch.bfloat16, device=dev)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for t in (a, b):
            fastcomm.all_reduce(t, ws, algo="pull")
        fastcomm.all_reduce(c, ws, algo="one_shot")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            oa = fastcomm.all_reduce(a, ws, algo="pull")
            oc = fastcomm.all_reduce(c, ws, algo="one_shot")
            ob = fastcomm.all_reduce(b, ws, algo="pull")
            oa2 = fastcomm.all_reduce(oa, ws, algo="pull")  # consumes the first result inside the graph
    torch.cuda.current_stream().wait_stream(s)
    ar, br, cr = (torch.arange(t.numel(), device=dev) for t in (a, b, c))
    checked = 0
    for i in range(replays):
        a.copy_(((ar + i) % 5 - 2).to(torch.bfloat16) * (rank + 1))
        b.copy_(((br + i) % 3 - 1).to(torch.bfloat16) * (rank + 1))
        c.copy_(((cr + i) % 7 - 3).to(torch.bfloat16) * (rank + 1))
        g.replay()
        assert torch.equal(oa, (((ar + i) % 5 - 2) * tri).to(torch.bfloat16)), f"replay {i}: pull (a) wrong"
        assert torch.equal(ob, (((br + i) % 3 - 1) * tri).to(torch.bfloat16)), f"replay {i}: pull (b) wrong"
        assert torch.equal(oc, (((cr + i) % 7 - 3) * tri).to(torch.bfloat16)), f"replay {i}: one-shot wrong"
        assert torch.equal(oa2, (((ar + i) % 5 - 2) * tri * world).to(torch.bfloat16)), f"replay {i}: chained pull"
        checked += 1
    torch.cuda.synchronize()
    return checked


# The island two-shot (two_shot_islands.cuh): sizes across its range (tails of every length, segments
# shorter than a vector or empty, several blocks, the workspace's largest message).
ISLAND_TWO_SHOT_SIZES = (1, 2, 3, 7, 9, 15, 17, 31, 33, 127, 1000, 4095, 6147, 40961, 65537, 100003, 300001)


def _island_graph(ws, replays):
    """One graph holding two island two-shots (odd size, in place), a one-shot (island form) and a flat
    two-shot, replayed with new inputs before every replay. Inputs that bf16 cannot sum exactly, so every
    output checks the rounding rule bit for bit (each rank builds every rank's terms itself)."""
    dev = ws.device
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = {"a": 100003, "b": 9, "c": 6144, "d": 40961}
    bufs = {k: torch.zeros(n, dtype=torch.bfloat16, device=dev) for k, n in sizes.items()}
    ramps = {k: torch.arange(n) for k, n in sizes.items()}

    def terms(k, i):
        return [((((ramps[k] + i) % 7) - 3) * ((r + 1) * 37 + i)).to(torch.bfloat16) for r in range(world)]

    def body():
        return {"a": fastcomm.all_reduce(bufs["a"], ws, algo="two_shot_islands"),
                "b": fastcomm.all_reduce(bufs["b"], ws, algo="two_shot_islands", out=bufs["b"]),
                "c": fastcomm.all_reduce(bufs["c"], ws, algo="one_shot"),
                "d": fastcomm.all_reduce(bufs["d"], ws, algo="two_shot")}

    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()  # warm-up outside capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            outs = body()
    torch.cuda.current_stream().wait_stream(s)
    checked = 0
    for i in range(replays):
        t = {k: terms(k, i) for k in sizes}
        for k, b in bufs.items():
            b.copy_(t[k][rank])
        g.replay()
        for k, o in outs.items():
            want = _reduce_like_fastcomm(t[k], torch.bfloat16, islands=None if k == "d" else "workspace")
            assert torch.equal(o.cpu(), want), f"replay {i}: {k} wrong"
        checked += 1
    torch.cuda.synchronize()
    return checked


def two_shot_islands(rank, world, gloo, islands, replays):
    """The island two-shot at one (world, islands) shape: exact sums over odd sizes and every dtype; random
    data bitwise equal to the island rule's CPU reference (island sum in member order rounded to the dtype,
    then the islands in order) on every rank, and to the one-shot island form wherever that can run; -0.0 /
    NaN / inf and the sentinel pattern, NaN-free results bitwise against the one-shot form; in place; the
    policy's choice; calls of every algorithm interleaved; graph replays."""
    global _CPU_GROUP, _ISLANDS
    _CPU_GROUP = gloo
    with fastcomm.Workspace(gloo, transport="p2p", islands=islands, max_bytes=2 << 20,
                            one_shot_max_bytes=256 << 10) as ws:
        _ISLANDS = ws.islands
        dev = ws.device
        found = {"describe": ws.describe(), "link": ws.plan.link.value,
                 "auto_1MiB": ws.algo_for(1 << 20).value}
        top = (2 << 20) // 4  # the workspace's largest fp32 message, in elements
        found["exact"] = _exact_vs_nccl(ws, ISLAND_TWO_SHOT_SIZES + (top,), ("two_shot_islands",), 31)
        random_checked = against_one_shot = 0
        for dtype in DTYPES:
            es = torch.tensor([], dtype=dtype).element_size()
            for n in (5, 4097, 65537, (256 << 10) // es, (2 << 20) // es - 3):
                g = torch.Generator(device="cpu").manual_seed(37 * n + rank)
                x = torch.randn(n, generator=g).to(dtype).to(dev)
                want = _ordered_sum(x)
                out = _poisoned(x)
                fastcomm.all_reduce(x, ws, algo="two_shot_islands", out=out)
                assert torch.equal(out, want), f"two_shot_islands {dtype} n={n}: not the island rule's sum"
                random_checked += 1
                if ws.algo_for(n * es, "one_shot") is not fastcomm.Algo.NCCL:
                    one = fastcomm.all_reduce(x, ws, algo="one_shot")
                    assert torch.equal(one, out), f"{dtype} n={n}: differs from the one-shot island form"
                    against_one_shot += 1
        found["random_bitwise"], found["against_one_shot"] = random_checked, against_one_shot
        _specials(ws, ("two_shot_islands",))
        # Specials and the sentinel pattern, bit for bit against the one-shot island form (-0.0 included; a
        # NaN matches any NaN: the one-shot sends the sentinel pattern as another NaN).
        raw = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
        for dtype in DTYPES:
            x = _ints(6147, dtype, rank, 41, dev)
            x[rank::7] = float("nan") if rank % 2 else -0.0
            x[3 * rank + 1] = float("inf") if rank % 3 else float("-inf")
            x[-1] = torch.tensor([-1], dtype=raw[dtype]).view(dtype).to(dev)[0]  # the sentinel pattern
            a = fastcomm.all_reduce(x, ws, algo="two_shot_islands")
            b = fastcomm.all_reduce(x, ws, algo="one_shot")
            assert _bits_match(a, b), f"{dtype}: specials differ from the one-shot island form"
            assert _bits_match(a.cpu(), _ordered_sum(x).cpu()) and _same_on_all_ranks(a), f"{dtype}: specials"
        for n in (3, 6147, 65537):  # in place
            x = _ints(n, torch.float16, rank, 43 + n, dev)
            want = _nccl_sum(x)
            fastcomm.all_reduce(x, ws, algo="two_shot_islands", out=x)
            assert torch.equal(x, want), f"in place n={n}"
        mix = ((100003, "two_shot_islands"), (6144, "one_shot"), (3, "two_shot_islands"), (300001, "auto"),
               (40961, "two_shot"), (1, "two_shot_islands"), (65537, "two_shot_islands"), (12345, "auto"))
        found["interleaved"] = _islands_back_to_back(ws, 16 * len(mix), mix)
        found["graph_replays"] = _island_graph(ws, replays)
        torch.cuda.synchronize()
    return found


def _islands_back_to_back(ws, calls, plan):
    """As _back_to_back, with the island rule wherever the call runs an island form (one-shot, island
    two-shot, and whatever auto picks)."""
    dev = ws.device
    rank, world = dist.get_rank(), dist.get_world_size()
    base = {n: _ints(n, torch.bfloat16, 0, n, dev) for n, _ in plan}
    outs = {n: torch.empty(n, dtype=torch.bfloat16, device=dev) for n, _ in plan}
    bad = good = 0
    for i in range(calls):
        n, algo = plan[i % len(plan)]
        k = (i % 5) + 1
        fastcomm.all_reduce(base[n] * ((rank + 1) * k), ws, algo=algo, out=outs[n])
        chosen = ws.algo_for(2 * n, None if algo == "auto" else algo)
        flat = chosen in (fastcomm.Algo.TWO_SHOT, fastcomm.Algo.TWO_SHOT_LL, fastcomm.Algo.PULL)
        want = _reduce_like_fastcomm([base[n] * ((r + 1) * k) for r in range(world)], torch.bfloat16,
                                     islands=None if flat else "workspace")
        if torch.equal(outs[n], want):
            good += 1
        else:
            bad += 1
    torch.cuda.synchronize()
    assert bad == 0, f"{bad} of {calls} interleaved calls wrong"
    return good
