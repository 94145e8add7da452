"""GPU tests (2+ GPUs): correctness of every op over each transport, graphs, timeouts, cleanup."""
import glob

import pytest

from fastcomm.spawn import check_all_ok, run_ranks
import gpu_workers as W

pytestmark = pytest.mark.gpu


def _world():
    import torch

    return min(torch.cuda.device_count(), 8)


@pytest.mark.parametrize("transport", ["p2p", "host"])
def test_core(transport):
    res = check_all_ok(run_ranks(W.core, _world(), transport, None, 10_000, 2_000, timeout=900))
    print(transport, res[0])
    assert res[0]["exact"] > 100 and res[0]["back_to_back"] == 10_000 and res[0]["graph_replays"] == 2_000
    assert res[0]["try_all_reduce"]


def test_forced_islands():
    world = _world()
    islands = tuple((r,) for r in range(world)) if world == 2 else (tuple(range(world // 2)), tuple(range(world // 2, world)))
    res = check_all_ok(run_ranks(W.core, world, "p2p", islands, 1_000, 200, timeout=900))
    assert "islands" in res[0]["describe"]


@pytest.mark.parametrize("transport,die", [("p2p", False), ("host", False), ("host", True)])
def test_missing_peer_times_out(transport, die):
    world = _world()
    results = run_ranks(W.timeout, world, transport, die, timeout=120, allow_exit=(world - 1,) if die else ())
    for r in range(world - 1):
        status, value = results[r]
        assert status == "ok", value
        assert value["message"] and f"rank {r} timed out" in value["message"] and f"peer rank {world - 1}" in value["message"], value
        assert value["shm_leftovers"] == [], value
    assert glob.glob("/dev/shm/fastcomm-*") == []
