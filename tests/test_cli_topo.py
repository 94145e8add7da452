"""`fastcomm topo`: no plan on 0-1 GPUs, the tuned rules where a tune cache applies, no islands proposed
beside a host-transport plan."""
from __future__ import annotations

import argparse
import json

import pytest

from fastcomm import tunecache as T
from fastcomm.commands import topo as topo_cli
from fastcomm.variables import VARIABLES
from fastcomm.policy import Algo, LinkType, PolicyKey, Rule, Transport
from fastcomm.topology import GpuInfo, Topology

NV, SYS = LinkType.NVLINK, LinkType.CROSS_SOCKET


def _topo(n, link=NV, p2p=True, name="NVIDIA H200"):
    gpus = tuple(GpuInfo(index=i, name=name, uuid=f"GPU-{i}") for i in range(n))
    return Topology(gpus=gpus, link=tuple(tuple(link for _ in range(n)) for _ in range(n)),
                    p2p=tuple(tuple(p2p for _ in range(n)) for _ in range(n)), source="recorded")


@pytest.fixture
def topo(monkeypatch, capsys, tmp_path):
    for var in VARIABLES:
        monkeypatch.delenv(var.name, raising=False)
    monkeypatch.setenv("FASTCOMM_CACHE_DIR", str(tmp_path / "cache"))

    def call(topology: Topology, *argv):
        path = tmp_path / "topo.json"
        path.write_text(json.dumps(topology.to_json()))
        parser = argparse.ArgumentParser(prog="fastcomm")
        topo_cli.add_parser(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["topo", "--from-file", str(path), *argv])
        rc = args.func(args)
        out, err = capsys.readouterr()
        return rc, out, err
    return call


@pytest.mark.parametrize("n", [0, 1])
def test_nothing_to_do_on_0_or_1_gpus(topo, n):
    rc, out, _ = topo(_topo(n))
    want = f"nothing to do on {n} GPU{'' if n == 1 else 's'} (fastcomm needs at least 2)"
    assert rc == 0 and out.splitlines()[-1] == f"plan: {want}" and "transport" not in out
    rc, out, _ = topo(_topo(n), "--json")
    data = json.loads(out)
    assert rc == 0 and data["plan"] is None and data["no_plan"] == want


def _write_cache(path, gpu_name="NVIDIA H200", count=2, rules=(Rule(4096, Algo.ONE_SHOT), Rule(1 << 20, Algo.TWO_SHOT))):
    cuda = T.cuda_version()
    from fastcomm import __version__

    fp = T.Fingerprint(gpu_name, count, Transport.P2P, NV, cuda, __version__)
    T.TuneCache(version=T.SCHEMA_VERSION, fingerprint=fp, table={PolicyKey(Transport.P2P, NV, count): rules},
                created="2026-12-01T00:00:00+00:00").save(path)


def test_topo_shows_the_tuned_rules_where_a_cache_applies(topo, tmp_path):
    pytest.importorskip("torch")  # the fingerprint holds torch's CUDA version
    _write_cache(tmp_path / "cache" / "tune.json")
    rc, out, _ = topo(_topo(2))
    assert rc == 0 and "tuned rules from" in out
    assert "  <= 4 KiB: one_shot" in out and "  4 KiB < size <= 1 MiB: two_shot" in out
    rc, out, _ = topo(_topo(2), "--json")
    plan = json.loads(out)["plan"]
    assert plan["rules_source"].startswith("tuned rules from")
    assert [r["algo"] for r in plan["ranges"]] == ["one_shot", "two_shot", "nccl"]


def test_a_cache_from_other_gpus_is_not_used(topo, tmp_path):
    pytest.importorskip("torch")
    _write_cache(tmp_path / "cache" / "tune.json", gpu_name="NVIDIA L40S")
    rc, out, _ = topo(_topo(2))
    assert rc == 0 and "measured on another setup" in out and "tuned rules" not in out


def test_without_torch_the_defaults_are_shown(topo, tmp_path, monkeypatch):
    _write_cache(tmp_path / "cache" / "tune.json") if T.cuda_version() else None
    monkeypatch.setattr(T, "cuda_version", lambda: None)
    rc, out, _ = topo(_topo(2))
    assert rc == 0 and "policy: defaults (torch is not installed" in out


def test_an_explicit_bad_tune_file_is_the_plan_s_answer(topo, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    monkeypatch.setenv("FASTCOMM_TUNE_FILE", str(bad))
    rc, out, _ = topo(_topo(2))
    assert rc == 0 and out.splitlines()[-1].startswith(f"plan: tune cache {bad}: invalid JSON")


def test_no_islands_proposed_beside_a_host_plan(topo):
    # Two sockets of two GPUs, no P2P anywhere: the links suggest islands, but the plan is the host transport,
    # which a workspace runs flat (it refuses islands there).
    t = _topo(4, p2p=False)
    fast = ((0, 1), (1, 0), (2, 3), (3, 2))
    t = Topology(gpus=t.gpus, p2p=t.p2p, source="recorded",
                 link=tuple(tuple(NV if (i, j) in fast else SYS for j in range(4)) for i in range(4)))
    rc, out, _ = topo(t)
    assert rc == 0 and "plan: transport host" in out
    assert "islands: [0 1] [2 3] by links, not used: the host transport is flat" in out
    assert "hierarchical" not in out
