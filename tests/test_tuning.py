import argparse
import json
import logging
import random
from pathlib import Path

import pytest

from fastcomm import commands as cli
from fastcomm import policy
from fastcomm import tunecache as T
from fastcomm.commands import tune as TC
from fastcomm.config import Config
from fastcomm.errors import FastcommError
from fastcomm.policy import Algo, PolicyKey, Rule, Transport
from fastcomm.policy import LinkType

KB, MB = 1 << 10, 1 << 20

FP = T.Fingerprint(gpu_name="NVIDIA L40S", gpu_count=4, transport=Transport.P2P, link=LinkType.HOST_BRIDGE,
                   cuda="12.8", fastcomm="0.1.0")
RULES = (Rule(256 * KB, Algo.ONE_SHOT), Rule(8 * MB, Algo.TWO_SHOT))


def make_cache(fp=FP, table=None):
    table = {PolicyKey(fp.transport, fp.link, fp.gpu_count): RULES} if table is None else table
    return T.TuneCache(version=T.SCHEMA_VERSION, fingerprint=fp, table=table, created="2026-12-01T00:00:00+00:00",
                       measurements=({"size": 1024, "algo": "one_shot", "us": 3.5, "wrong": 0},))


def write(path, data):
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


# ---- round trip ----------------------------------------------------------------------------------------

def test_json_and_file_round_trip(tmp_path):
    cache = make_cache(table={PolicyKey(Transport.P2P, LinkType.HOST_BRIDGE, 4): RULES,
                              PolicyKey(Transport.HOST, LinkType.UNKNOWN, 0, "float32"): (),
                              PolicyKey(Transport.P2P, LinkType.UNKNOWN, 0): (Rule(1, Algo.TWO_SHOT),)})
    assert T.TuneCache.from_json(json.loads(json.dumps(cache.to_json()))) == cache
    path = cache.save(tmp_path / "sub" / "tune.json")  # parents are created
    assert T.load(path) == cache


def test_save_is_atomic_replace(tmp_path):
    path = tmp_path / "tune.json"
    make_cache().save(path)
    other = make_cache(fp=T.Fingerprint("NVIDIA H200", 2, Transport.HOST, LinkType.UNKNOWN, "13.0", "0.1.0"))
    other.save(path)
    assert T.load(path) == other
    assert [p.name for p in tmp_path.iterdir()] == ["tune.json"]  # no temporary left behind


def test_default_path():
    assert T.default_path(Path("/x/y")) == Path("/x/y/tune.json")


# ---- rejection -----------------------------------------------------------------------------------------

def _good():
    return make_cache().to_json()


def _edit(fn):
    data = _good()
    fn(data)
    return data


def _set_rule(i, key, value):
    return _edit(lambda d: d["table"][0]["rules"][i].__setitem__(key, value))


BAD = {
    "invalid JSON": ("{not json", "invalid JSON"),
    "foreign: bench result": ({"meta": {}, "rows": []}, "not a fastcomm tune cache"),
    "foreign: list": ([1, 2], "not a fastcomm tune cache"),
    "newer schema": (_edit(lambda d: d.__setitem__("version", 2)), "schema version 2, this fastcomm reads version 1"),
    "version as text": (_edit(lambda d: d.__setitem__("version", "1")), "field 'version' must be an integer"),
    "no fingerprint": (_edit(lambda d: d.pop("fingerprint")), "'fingerprint'"),
    "no gpu name": (_edit(lambda d: d["fingerprint"].pop("gpu_name")), "missing field 'fingerprint.gpu_name'"),
    "gpu count bool": (_edit(lambda d: d["fingerprint"].__setitem__("gpu_count", True)),
                       "'fingerprint.gpu_count' must be an integer"),
    "no created": (_edit(lambda d: d.pop("created")), "missing field 'created'"),
    "no table": (_edit(lambda d: d.pop("table")), "'table'"),
    "table entry not object": (_edit(lambda d: d.__setitem__("table", ["p2p"])), "'table[0]'"),
    "world size text": (_edit(lambda d: d["table"][0].__setitem__("world_size", "4")),
                        "'table[0].world_size' must be an integer"),
    "rules not list": (_edit(lambda d: d["table"][0].__setitem__("rules", {})), "'table[0].rules' must be a list"),
    "max_bytes float": (_set_rule(0, "max_bytes", 1.5), "'table[0].rules[0].max_bytes' must be an integer"),
    "max_bytes zero": (_set_rule(0, "max_bytes", 0), "must be positive"),
    "max_bytes negative": (_set_rule(0, "max_bytes", -4), "must be positive"),
    "unsorted": (_set_rule(1, "max_bytes", 4 * KB), "not sorted by max_bytes"),
    "duplicate bound": (_set_rule(1, "max_bytes", 256 * KB), "not sorted by max_bytes"),
    "unknown algo": (_set_rule(0, "algo", "three_shot"), "unknown Algo 'three_shot'"),
    "unknown transport": (_edit(lambda d: d["table"][0].__setitem__("transport", "rdma")), "unknown Transport 'rdma'"),
    "unknown link": (_edit(lambda d: d["table"][0].__setitem__("link", "nvswitch")), "unknown LinkType 'nvswitch'"),
    "unknown fingerprint link": (_edit(lambda d: d["fingerprint"].__setitem__("link", "pix")),
                                 "unknown LinkType 'pix' at 'fingerprint.link'"),
    "unknown dtype": (_edit(lambda d: d["table"][0].__setitem__("dtype", "int8")), "unknown dtype 'int8'"),
    "repeated entry": (_edit(lambda d: d["table"].append(dict(d["table"][0]))), "repeats the entry"),
    "measurements ill-typed": (_edit(lambda d: d.__setitem__("measurements", [1])), "'measurements'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_rejects_bad_cache_naming_file_and_problem(tmp_path, case):
    data, problem = BAD[case]
    path = write(tmp_path / "tune.json", data)
    with pytest.raises(T.TuneCacheError) as e:
        T.load(path)
    msg = str(e.value)
    assert str(path) in msg and problem in msg, msg
    assert isinstance(e.value, FastcommError)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(T.TuneCacheError, match=r"tune cache .*nope\.json: no such file"):
        T.load(tmp_path / "nope.json")


def test_measurements_are_optional(tmp_path):
    data = _edit(lambda d: d.pop("measurements"))
    assert T.load(write(tmp_path / "t.json", data)).measurements == ()


# ---- fingerprint and rules_from_file -------------------------------------------------------------------

def test_fingerprint_matches_names_what_differs():
    assert FP.matches(FP) is None
    other = T.Fingerprint("NVIDIA H200", 4, Transport.P2P, LinkType.NVLINK, "12.8", "0.1.0")
    why = FP.matches(other)
    assert "gpu_name 'NVIDIA L40S' (cache) != 'NVIDIA H200' (here)" in why
    assert "link 'host_bridge' (cache) != 'nvlink' (here)" in why
    assert "cuda" not in why and "gpu_count" not in why


def test_explicit_file_is_used(tmp_path):
    path = make_cache().save(tmp_path / "mine.json")
    rules, why = T.rules_from_file(Config(tune_file=path, cache_dir=tmp_path / "none"), FP)
    assert rules == RULES and str(path) in why


def test_explicit_file_must_be_valid(tmp_path):
    path = write(tmp_path / "mine.json", "garbage")
    with pytest.raises(T.TuneCacheError, match="mine.json: invalid JSON"):
        T.rules_from_file(Config(tune_file=path), FP)
    with pytest.raises(T.TuneCacheError, match="no such file"):
        T.rules_from_file(Config(tune_file=tmp_path / "absent.json"), FP)


def test_default_path_is_used_when_present(tmp_path):
    make_cache().save(T.default_path(tmp_path))
    rules, _ = T.rules_from_file(Config(cache_dir=tmp_path), FP)
    assert rules == RULES


def test_no_cache_means_defaults(tmp_path):
    rules, why = T.rules_from_file(Config(cache_dir=tmp_path), FP)
    assert rules is None and "no tune cache" in why


def test_corrupt_default_file_is_skipped_with_warning(tmp_path, caplog):
    write(T.default_path(tmp_path), "{")
    with caplog.at_level(logging.WARNING, logger="fastcomm"):
        rules, why = T.rules_from_file(Config(cache_dir=tmp_path), FP)
    assert rules is None and "invalid JSON" in why
    assert "invalid JSON" in caplog.text and str(T.default_path(tmp_path)) in caplog.text


@pytest.mark.parametrize("explicit", [True, False])
def test_foreign_machine_cache_falls_back_with_warning(tmp_path, caplog, explicit):
    path = make_cache().save(T.default_path(tmp_path))
    here = T.Fingerprint("NVIDIA L40S", 8, Transport.P2P, LinkType.HOST_BRIDGE, "12.8", "0.2.0")
    cfg = Config(tune_file=path if explicit else None, cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="fastcomm"):
        rules, why = T.rules_from_file(cfg, here)
    assert rules is None
    for text in (why, caplog.text):
        assert "gpu_count 4 (cache) != 8 (here)" in text and "fastcomm '0.1.0' (cache) != '0.2.0' (here)" in text
        assert str(path) in text


def test_cache_without_an_entry_for_this_run(tmp_path, caplog):
    path = make_cache(table={PolicyKey(Transport.HOST, LinkType.UNKNOWN, 0): RULES}).save(tmp_path / "t.json")
    with caplog.at_level(logging.WARNING, logger="fastcomm"):
        rules, why = T.rules_from_file(Config(tune_file=path), FP)
    assert rules is None and "no entry" in why


def test_tuned_always_nccl_is_an_answer_not_a_miss(tmp_path):
    path = make_cache(table={PolicyKey(Transport.P2P, LinkType.HOST_BRIDGE, 4): ()}).save(tmp_path / "t.json")
    assert T.rules_from_file(Config(tune_file=path), FP)[0] == ()


# ---- rules_from_measurements ---------------------------------------------------------------------------

SIZES = [1 * KB, 4 * KB, 16 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB]


def rows(table):
    """{size: (one_shot, two_shot, nccl)} -> rows; None leaves the point out."""
    out = []
    for s, times in table.items():
        for algo, t in zip(("one_shot", "two_shot", "nccl"), times):
            if t is not None:
                out.append({"size": s, "algo": algo, "us": t})
    return out


def test_crossover_merging_and_nccl_tail():
    data = {1 * KB: (3, 7, 6), 4 * KB: (3.2, 7, 6), 16 * KB: (3.5, 7, 6.5), 64 * KB: (4.5, 7.5, 7),
            256 * KB: (8, 7.9, 9), 1 * MB: (12, 10, 14), 4 * MB: (None, 30, 29), 16 * MB: (None, 80, 70)}
    assert T.rules_from_measurements(rows(data), SIZES) == (Rule(64 * KB, Algo.ONE_SHOT), Rule(1 * MB, Algo.TWO_SHOT))


def test_margin_decides_the_tail():
    data = {1 * KB: (3, 7, 6), 4 * KB: (5.9, 7, 6)}  # 1.7% faster at 4K: within noise, NCCL keeps it
    assert T.rules_from_measurements(rows(data), [1 * KB, 4 * KB]) == (Rule(1 * KB, Algo.ONE_SHOT),)
    assert T.rules_from_measurements(rows(data), [1 * KB, 4 * KB], margin=0.01) == (Rule(4 * KB, Algo.ONE_SHOT),)


def test_dip_in_the_middle_stays_fastcomm():
    data = {1 * KB: (3, 7, 6), 4 * KB: (6.5, 7, 6), 16 * KB: (4, 7, 8)}
    assert T.rules_from_measurements(rows(data), [1 * KB, 4 * KB, 16 * KB]) == (Rule(16 * KB, Algo.ONE_SHOT),)


def test_alternating_winners_make_separate_rules():
    data = {1 * KB: (3, 4, 9), 4 * KB: (5, 4, 9), 16 * KB: (5, 6, 9)}
    assert T.rules_from_measurements(rows(data), [1 * KB, 4 * KB, 16 * KB]) == (
        Rule(1 * KB, Algo.ONE_SHOT), Rule(4 * KB, Algo.TWO_SHOT), Rule(16 * KB, Algo.ONE_SHOT))


def test_nccl_always_wins_gives_no_rules():
    data = {s: (10, 12, 5) for s in SIZES}
    assert T.rules_from_measurements(rows(data), SIZES) == ()


def test_gap_without_fastcomm_timing_is_nccl():
    data = {1 * KB: (3, 7, 6), 4 * KB: (None, None, 6), 16 * KB: (3, 7, 6)}
    assert T.rules_from_measurements(rows(data), [1 * KB, 4 * KB, 16 * KB]) == (
        Rule(1 * KB, Algo.ONE_SHOT), Rule(4 * KB, Algo.NCCL), Rule(16 * KB, Algo.ONE_SHOT))


def test_deterministic_ties_and_row_order():
    data = {1 * KB: (4, 4, 9), 4 * KB: (5, 4, 9), 16 * KB: (6, 5, 9)}
    r = rows(data)
    want = T.rules_from_measurements(r, [1 * KB, 4 * KB, 16 * KB])
    assert want == (Rule(1 * KB, Algo.ONE_SHOT), Rule(16 * KB, Algo.TWO_SHOT))  # a tie goes to one-shot
    for seed in range(5):
        random.Random(seed).shuffle(r)
        assert T.rules_from_measurements(r, [16 * KB, 1 * KB, 4 * KB]) == want


def test_missing_nccl_timing_is_an_error():
    with pytest.raises(ValueError, match="no NCCL timing for size 4096"):
        T.rules_from_measurements(rows({1 * KB: (3, 7, 6), 4 * KB: (3, 7, None)}), [1 * KB, 4 * KB])


def test_measured_rules_survive_the_cache(tmp_path):
    data = {1 * KB: (3, 7, 6), 1 * MB: (12, 10, 14)}
    rules = T.rules_from_measurements(rows(data), [1 * KB, 1 * MB])
    cache = make_cache(table={PolicyKey(Transport.P2P, LinkType.HOST_BRIDGE, 4): rules})
    assert T.load(cache.save(tmp_path / "t.json")).table == cache.table


def test_rules_render_as_ranges():
    ranges = policy.size_ranges(RULES, one_shot_max_bytes=8 * MB, max_bytes=8 * MB)
    assert policy.render_ranges(ranges) == [
        "<= 256 KiB: one_shot", "256 KiB < size <= 8 MiB: two_shot", "> 8 MiB: nccl (not fastcomm)"]
    assert policy.render_ranges(policy.size_ranges((), one_shot_max_bytes=MB, max_bytes=MB)) == \
        ["all sizes: nccl (not fastcomm)"]


# ---- command line --------------------------------------------------------------------------------------

def test_tune_help_builds(capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["tune", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--world", "--transport", "-b", "-e", "-f", "-n", "--out"):
        assert flag in out


def test_tune_arguments_parse():
    args = cli.build_parser().parse_args(["tune", "--world", "2", "--transport", "host", "-b", "4K", "-e", "2M",
                                          "-f", "4", "-n", "10", "--out", "/tmp/t.json"])
    assert (args.world, args.transport, args.min_bytes, args.max_size, args.factor, args.iters, args.out) == (
        2, "host", 4 * KB, 2 * MB, 4.0, 10, "/tmp/t.json")
    assert args.func is TC.tune


FP2 = T.Fingerprint("NVIDIA L40S", 2, Transport.P2P, LinkType.HOST_BRIDGE, "12.8", "0.1.0")


def _fake_ranks(rows):
    """run_ranks stand-in: rank 0 returns (fingerprint, rows) as _tune_rank does."""
    def run_ranks(fn, world, *args, timeout, backend):
        assert fn is TC._tune_rank and world == 2 and backend == "nccl"  # one GPU per rank: NCCL rows
        return {0: ("ok", (FP2.to_json(), rows)), 1: ("ok", None)}
    return run_ranks


@pytest.fixture(autouse=False)
def gpus_ready(monkeypatch):
    """Two GPUs and compiled kernels, as far as the command's checks before the spawn are concerned."""
    monkeypatch.setattr(TC, "prepare_gpus", lambda world, cache_dir: (world or 2, None))


def _tune_args(out):
    return cli.build_parser().parse_args(["tune", "--world", "2", "-b", "1K", "-e", "1M", "-f", "1024",
                                          "--out", str(out)])


def test_tune_decides_and_writes_on_rank_0_timings(tmp_path, monkeypatch, capsys, gpus_ready):
    import fastcomm.spawn

    data = rows({1 * KB: (3, 7, 6), 1 * MB: (12, 10, 14)})
    monkeypatch.setattr(fastcomm.spawn, "run_ranks", _fake_ranks([dict(r, wrong=0) for r in data]))
    out = tmp_path / "tune.json"
    assert TC.tune(_tune_args(out)) == 0
    cache = T.load(out)
    assert cache.fingerprint == FP2 and len(cache.measurements) == 6
    want = (Rule(1 * KB, Algo.ONE_SHOT), Rule(1 * MB, Algo.TWO_SHOT))
    assert T.rules_from_file(Config(tune_file=out), FP2)[0] == want
    assert cache.table == {PolicyKey(Transport.P2P, LinkType.HOST_BRIDGE, 2): want}
    assert "1 KiB < size <= 1 MiB: two_shot" in capsys.readouterr().out


def test_tune_refuses_wrong_results(tmp_path, monkeypatch, capsys, gpus_ready):
    import fastcomm.spawn

    data = [dict(r, wrong=int(r["algo"] == "two_shot")) for r in rows({1 * KB: (3, 7, 6)})]
    monkeypatch.setattr(fastcomm.spawn, "run_ranks", _fake_ranks(data))
    assert TC.tune(_tune_args(tmp_path / "tune.json")) == 1
    assert not (tmp_path / "tune.json").exists() and "wrong results" in capsys.readouterr().err


@pytest.mark.gpu
def test_tune_writes_a_loadable_cache(tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("tune times NCCL beside fastcomm: one GPU per rank, 2+ GPUs")
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    TC.add_parser(sub)
    out = tmp_path / "tune.json"
    opts = p.parse_args(["tune", "--world", "2", "-b", "1K", "-e", "1M", "-f", "8", "-n", "5", "--out", str(out)])
    assert TC.tune(opts) == 0
    cache = T.load(out)
    assert cache.fingerprint.gpu_count == 2 and len(cache.table) == 1
    assert {m["algo"] for m in cache.measurements} == {"one_shot", "two_shot", "nccl"}


def test_tune_times_every_fastcomm_algorithm_and_can_pick_the_new_ones():
    from fastcomm.commands import tune as T
    from fastcomm.policy import Algo
    from fastcomm.tunecache import FASTCOMM_ALGOS, rules_from_measurements

    assert {Algo.TWO_SHOT_LL, Algo.PULL} <= set(FASTCOMM_ALGOS)
    head = T.table_header(8)
    assert all(a.value in head for a in FASTCOMM_ALGOS)
    rows = [dict(size=4096, algo="one_shot", us=5.0), dict(size=4096, algo="nccl", us=20.0),
            dict(size=65536, algo="one_shot", us=30.0), dict(size=65536, algo="two_shot_ll", us=9.0),
            dict(size=65536, algo="nccl", us=25.0), dict(size=1 << 20, algo="pull", us=8.0),
            dict(size=1 << 20, algo="two_shot", us=11.0), dict(size=1 << 20, algo="nccl", us=14.0)]
    rules = rules_from_measurements(rows, [4096, 65536, 1 << 20])
    assert [r.algo for r in rules] == [Algo.ONE_SHOT, Algo.TWO_SHOT_LL, Algo.PULL]
