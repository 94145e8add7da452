"""Rank bodies for tests/test_spawn.py (importable by spawned processes)."""
import time


def ok(rank, world, group):
    return rank * 2


def hang_on_rank_1(rank, world, group):
    if rank == 1:
        time.sleep(600)  # a deadlocked rank
    return "done"


def raise_on_rank_0(rank, world, group):
    if rank == 0:
        raise ValueError("boom")
    return "fine"
