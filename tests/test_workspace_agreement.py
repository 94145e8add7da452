"""A rank that fails a local step alone makes every rank raise (naming it) instead of leaving them waiting.

Runs Workspace's agreement step over a real gloo group on the CPU (two processes, no GPU).
"""
import multiprocessing as mp
import socket

import pytest

torch = pytest.importorskip("torch")


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, port, q):
    import torch.distributed as dist

    from fastcomm.errors import FastcommError
    from fastcomm.workspace import Workspace

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    class Stub:
        group, world_size = dist.group.WORLD, 2
        _gather = Workspace._gather
        _all_ok = Workspace._all_ok
        _decided_by_rank0 = Workspace._decided_by_rank0

    stub = Stub()
    stub.rank = rank
    decided = stub._decided_by_rank0(lambda: f"chosen by rank {rank}", "default")
    failed = stub._decided_by_rank0(lambda: 1 / 0, "default")
    ok = stub._all_ok("step one", lambda: rank * 10)

    def fail_on_rank_1():
        if rank == 1:
            raise MemoryError("out of device memory")
        return "fine"

    try:
        stub._all_ok("allocating device memory", fail_on_rank_1)
        q.put((rank, ok, None, decided, failed))
    except FastcommError as e:
        q.put((rank, ok, str(e), decided, failed))
    dist.destroy_process_group()


def test_a_local_failure_is_raised_on_every_rank():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    for rank, ok, err, decided, failed in got:
        assert decided == ("chosen by rank 0", None)  # every rank gets rank 0's answer
        assert failed[0] == "default" and "ZeroDivisionError" in failed[1]
        assert ok == [0, 10]
        assert err is not None and "allocating device memory failed on rank 1" in err and "out of device memory" in err
