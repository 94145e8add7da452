"""A rank that fails a local step alone makes every rank raise (naming it) instead of leaving them waiting.

Runs the workspace's agreement steps (fastcomm.handshake) over a real gloo group on the CPU (two processes,
no GPU), through the one spawn harness.
"""
import pytest

pytest.importorskip("torch")

from fastcomm.spawn import check_all_ok, run_ranks  # noqa: E402
import spawn_bodies  # noqa: E402


def test_a_local_failure_is_raised_on_every_rank():
    got = check_all_ok(run_ranks(spawn_bodies.handshake_steps, 2, backend="gloo", timeout=120))
    for ok, err, decided, failed in got:
        assert decided == ("chosen by rank 0", None)  # every rank gets rank 0's answer
        assert failed[0] == "default" and "ZeroDivisionError" in failed[1]
        assert ok == [0, 10]
        assert err is not None and "allocating device memory failed on rank 1" in err and "out of device memory" in err


def test_a_failed_build_reports_its_cause_not_the_cleanups():
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without a usable CUDA driver")
    got = check_all_ok(run_ranks(spawn_bodies.failed_build, 2, backend="gloo", timeout=120))
    for msg in got:
        assert msg != "built" and "InsufficientDriver" not in msg and "cudaError" not in msg, msg
