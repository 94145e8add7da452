"""Rank bodies for tests/test_spawn.py (importable by spawned processes)."""
import time


def ok(rank, world, group):
    return rank * 2


def hang_on_rank_1(rank, world, group):
    # Both ranks past the group's set-up first: else rank 0 may finish and take the rendezvous store with it
    # while rank 1's gloo still connects, and rank 1 fails on a reset socket instead of hanging.
    import torch.distributed as dist

    dist.barrier(group)
    if rank == 1:
        time.sleep(600)  # a deadlocked rank
    return "done"


def raise_on_rank_0(rank, world, group):
    # Both ranks past the group's set-up first, as in hang_on_rank_1: else rank 1 may return and exit while rank
    # 0's gloo still connects, and rank 0 reports "connectFullMesh failed" instead of its own error.
    import torch.distributed as dist

    dist.barrier(group)
    if rank == 0:
        raise ValueError("boom")
    return "fine"


def handshake_steps(rank, world, group):
    """The workspace's agreement steps on a gloo group: rank 0 decides, and a lone failure is shared."""
    from fastcomm.errors import FastcommError
    from fastcomm.handshake import Handshake

    hs = Handshake(group)
    decided = hs.decided_by_rank0(lambda: f"chosen by rank {rank}", "default")
    failed = hs.decided_by_rank0(lambda: 1 / 0, "default")
    ok = hs.all_ok("step one", lambda: rank * 10)

    def fail_on_rank_1():
        if rank == 1:
            raise MemoryError("out of device memory")
        return "fine"

    try:
        hs.all_ok("allocating device memory", fail_on_rank_1)
        err = None
    except FastcommError as e:
        err = str(e)
    return ok, err, decided, failed


def failed_build(rank, world, group):
    """A workspace build that fails (here: no CUDA driver on a CPU machine) must raise its own cause, not
    whatever the cleanup after it raises (CuPy's cudaErrorInsufficientDriver, once)."""
    import fastcomm

    try:
        fastcomm.Workspace(group, device=0)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "built"
