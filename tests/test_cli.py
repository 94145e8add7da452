"""The `fastcomm` command's answers to ordinary mistakes: one line on stderr naming the flag or setting, a
non-zero exit, no traceback (issue 12). Runs on CPU: GPU-side steps are replaced where a test needs them."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fastcomm import commands as cli
from fastcomm.runtime import jit
from fastcomm.commands import args as A
from fastcomm.variables import VARIABLES


@pytest.fixture
def run(monkeypatch, capsys):
    """fastcomm ARGV -> (exit status, stdout, stderr), argparse's exits included, with a clean environment."""
    import os

    for name in [n for n in os.environ if n.startswith("FASTCOMM_")]:
        monkeypatch.delenv(name)

    def call(*argv, env=None):
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        try:
            rc = cli.main(list(argv))
        except SystemExit as e:
            rc = e.code
        out, err = capsys.readouterr()
        return rc, out, err
    return call


def one_line(err: str) -> str:
    """The error line; anything before it may only be argparse's usage text."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and lines and lines[-1].startswith("fastcomm"), err
    assert all(line.startswith(("usage:", " ")) for line in lines[:-1]), err
    return lines[-1]


def test_version(run):
    from fastcomm import __version__

    rc, out, _ = run("--version")
    assert rc == 0 and out.strip() == f"fastcomm {__version__}"


# ---- fastcomm env --------------------------------------------------------------------------------------

def test_env_shows_current_values_and_exits_1_on_a_bad_one(run):
    rc, out, err = run("env", env={"FASTCOMM_TIMEOUT_S": "abc", "FASTCOMM_MAX_BYTES": "8M"})
    assert rc == 1
    assert "FASTCOMM_TIMEOUT_S = 'abc'  [INVALID: FASTCOMM_TIMEOUT_S='abc': not a number of seconds]" in out
    assert "FASTCOMM_MAX_BYTES = '8M'  [ok]" in out
    assert "FASTCOMM_ALGO = unset (default 'auto')  [ok]" in out
    assert "Bound on every device-side wait" in out  # the meaning
    assert one_line(err) == "fastcomm env: 1 invalid setting: FASTCOMM_TIMEOUT_S"


def test_env_names_a_fastcomm_name_that_is_no_setting(run):
    """A typo or a removed setting is ignored by fastcomm: env says so (and still exits 0 when all else is
    valid); the repository's own script variables are not settings and are not named."""
    rc, out, err = run("env", env={"FASTCOMM_GGUF_GROUPED_FORM": "grouped1", "FASTCOMM_TIMOUT_S": "5",
                                   "FASTCOMM_COMMIT": "abc1234"})
    assert rc == 0
    assert err.splitlines() == ["fastcomm env: FASTCOMM_GGUF_GROUPED_FORM is not a fastcomm setting; it is ignored",
                                "fastcomm env: FASTCOMM_TIMOUT_S is not a fastcomm setting; it is ignored"]


def test_env_all_valid_exits_0(run):
    rc, out, err = run("env", env={"FASTCOMM_LOG": "info"})
    assert rc == 0 and not err and "FASTCOMM_LOG = 'info'  [ok]" in out
    assert all(v.name in out for v in VARIABLES)


# ---- fastcomm compile ----------------------------------------------------------------------------------

@pytest.fixture
def no_compile(monkeypatch):
    """jit.cached_cubin stand-in that records its calls and writes a fake cubin."""
    calls = []

    def fake(arch, cache_dir, *a, **k):
        calls.append(arch)
        path = Path(cache_dir) / f"fastcomm-{arch}.cubin"
        path.write_bytes(b"\x7fELF")
        return path
    monkeypatch.setattr(jit, "cached_cubin", fake)
    monkeypatch.setattr(A, "cupy_missing", lambda: None)
    return calls


@pytest.mark.parametrize("arch,says", [
    ("sm_75", "sm_75: fastcomm needs sm_80 or newer"),
    ("90", "'90': expected an architecture like sm_80, sm_90, sm_120"),
    ("sm_xyz", "'sm_xyz': expected an architecture like"),
])
def test_compile_refuses_bad_archs_in_one_line(run, no_compile, tmp_path, arch, says):
    rc, _, err = run("compile", "--arch", arch, "--cache-dir", str(tmp_path))
    assert rc == 2 and says in one_line(err) and "--arch" in err and not no_compile


def test_compile_checks_the_cache_dir_before_compiling(run, no_compile):
    rc, _, err = run("compile", "--arch", "sm_90", "--cache-dir", "/proc/nope")
    assert rc == 2 and one_line(err).startswith("fastcomm compile: --cache-dir: cannot write to /proc/nope")
    assert not no_compile
    rc, _, err = run("compile", "--arch", "sm_90", env={"FASTCOMM_CACHE_DIR": "/proc/nope"})
    assert rc == 2 and "FASTCOMM_CACHE_DIR: cannot write to /proc/nope" in one_line(err) and not no_compile


def test_compile_ignores_unrelated_bad_settings(run, no_compile, tmp_path):
    rc, out, err = run("compile", "--arch", "sm_90", "--unit", "comm", env={"FASTCOMM_TIMEOUT_S": "abc",
                                                         "FASTCOMM_CACHE_DIR": str(tmp_path)})
    assert rc == 0 and not err and no_compile == ["sm_90"] and str(tmp_path) in out


def test_compile_without_cupy_names_the_extra(run, monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("cupy") else real(name, *a))
    monkeypatch.setattr(jit, "cached_cubin", lambda *a, **k: pytest.fail("compiled without CuPy"))
    rc, _, err = run("compile", "--cache-dir", str(tmp_path))
    line = one_line(err)
    assert rc == 2 and "CuPy is not installed" in line and 'pip install -e ".[cuda13]"' in line and "cuda12" in line


def test_compile_notice_only_when_it_really_compiles(monkeypatch, tmp_path, capsys):
    def slow(arch, cache_dir, *a, **k):
        time.sleep(1.0)
        return tmp_path / "x.cubin"
    monkeypatch.setattr(jit, "cached_cubin", slow)
    A.compile_with_notice("sm_90", tmp_path)
    assert capsys.readouterr().err == "compiling kernels for sm_90 (first use, about half a minute)...\n"
    monkeypatch.setattr(jit, "cached_cubin", lambda *a, **k: tmp_path / "x.cubin")  # a cache hit
    A.compile_with_notice("sm_90", tmp_path)
    time.sleep(0.7)  # past the notice's delay: a cancelled notice must stay silent
    assert capsys.readouterr().err == ""


# ---- fastcomm tune and fastcomm bench: the same answers ------------------------------------------------

@pytest.fixture
def no_gpus(monkeypatch):
    monkeypatch.setattr(A, "visible_gpus", lambda: (0, "CUDA unavailable: Found no NVIDIA driver on your system"))

    def never(*a, **k):
        raise AssertionError("ranks spawned")
    import fastcomm.spawn

    monkeypatch.setattr(fastcomm.spawn, "run_ranks", never)


@pytest.mark.parametrize("verb", ["tune", "bench"])
def test_too_few_gpus_says_how_many_and_why(run, no_gpus, verb, tmp_path):
    rc, out, err = run(verb, "--json" if verb == "bench" else "--out", str(tmp_path / "x.json"))
    assert rc == 2 and not out.strip()
    assert one_line(err) == (f"fastcomm {verb}: needs at least 2 GPUs, found 0 GPUs "
                             "(CUDA unavailable: Found no NVIDIA driver on your system)")


@pytest.mark.parametrize("verb", ["tune", "bench"])
def test_world_beyond_the_gpus_found(run, monkeypatch, verb):
    monkeypatch.setattr(A, "visible_gpus", lambda: (2, ""))
    rc, _, err = run(verb, "--world", "4")
    assert rc == 2 and one_line(err) == f"fastcomm {verb}: --world 4: found 2 GPUs"
    rc, _, err = run(verb, "--world", "1")
    assert rc == 2 and "--world 1: needs at least 2 ranks" in one_line(err)


@pytest.mark.parametrize("verb", ["tune", "bench"])
@pytest.mark.parametrize("flags,says", [
    (["-b", "0"], "'0': a size here must be at least 1 byte"),
    (["-b=-1K"], "not a size: '-1K'"),
    (["-e", "12Q"], "not a size: '12Q'"),
    (["-f", "0"], "must be a finite number > 0"),
    (["-f", "inf"], "must be a finite number > 0"),
    (["-n", "0"], "must be at least 1"),
    (["-G", "x"], "is not a whole number"),
])
def test_bad_sweep_flags_are_one_line(run, no_gpus, verb, flags, says):
    rc, _, err = run(verb, *flags)
    assert rc == 2 and says in one_line(err)


@pytest.mark.parametrize("verb", ["tune", "bench"])
def test_a_sweep_that_would_not_end_is_refused(run, no_gpus, verb):
    rc, _, err = run(verb, "-b", "1", "-e", "1G", "-f", "1.001")
    assert rc == 2 and "step factor 1.001" in one_line(err)
    rc, _, err = run(verb, "-b", "1", "-e", "1M", "-f", "1")  # steps of 1 byte: a million points
    assert rc == 2 and "more than 1000 points" in one_line(err)


def test_bench_transports_are_checked(run, no_gpus):
    rc, _, err = run("bench", "--transports", "xyz")
    assert rc == 2 and "--transports" in err and "comma list of p2p, host" in one_line(err)
    rc, _, err = run("bench", "--transports", "p2p,nvlink")
    assert rc == 2 and "comma list of p2p, host" in one_line(err)


def test_bench_workspace_size_flag_does_not_collide_with_maxbytes():
    import argparse

    from fastcomm_bench import bench_allreduce as B

    p = argparse.ArgumentParser()
    B.add_arguments(p)
    o = p.parse_args(["-e", "1M", "--workspace-bytes", "16M", "--host-workspace-bytes", "2M"])
    assert (o.max_size, o.workspace_bytes, o.host_workspace_bytes) == (1 << 20, 16 << 20, 2 << 20)
    with pytest.raises(SystemExit):
        p.parse_args(["--max-bytes", "16M"])  # the old name, which read like -e/--maxbytes


@pytest.mark.parametrize("verb,flag", [("bench", "--json"), ("bench", "--plot"), ("tune", "--out")])
def test_output_paths_are_checked_before_the_run(run, monkeypatch, verb, flag):
    monkeypatch.setattr(A, "visible_gpus", lambda: pytest.fail("checked GPUs before the output path"))
    rc, _, err = run(verb, flag, "/proc/nope/x.json")
    assert rc == 2 and one_line(err).startswith(f"fastcomm {verb}: {flag}: cannot write /proc/nope/x.json")


@pytest.mark.parametrize("verb", ["tune", "bench", "topo"])
def test_a_bad_setting_stops_the_command_in_one_line(run, no_gpus, verb):
    rc, _, err = run(verb, env={"FASTCOMM_TIMEOUT_S": "abc"})
    assert rc == 2 and one_line(err).endswith("FASTCOMM_TIMEOUT_S='abc': not a number of seconds")


def test_bench_prints_the_header_before_the_run_and_rows_as_they_come(run, monkeypatch, tmp_path):
    import fastcomm.spawn
    from fastcomm_bench import bench_allreduce as B

    monkeypatch.setattr(A, "prepare_gpus", lambda world, cache: (2, None))
    monkeypatch.setattr(B, "prepare_gpus", lambda world, cache: (2, None))
    row = dict(size=12288, count=6144, type="bfloat16", redop="sum", impl="nccl", graph_us=8.0, eager_us=9.0,
               wrong=0)

    def fake_ranks(fn, world, opts, timeout, backend):
        assert backend == "nccl"  # the benchmark compares with NCCL: one GPU per rank
        assert fn is B.bench_rank
        B._show(row, 0, world)  # what rank 0 does after each measurement
        B._show(row, 1, world)  # other ranks print nothing
        return {0: ("ok", [row]), 1: ("ok", None)}
    monkeypatch.setattr(fastcomm.spawn, "run_ranks", fake_ranks)
    monkeypatch.setattr(B, "plot", lambda rows, world, path, title="": Path(path))
    import torch

    monkeypatch.setattr(torch.cuda, "nccl", type("N", (), {"version": staticmethod(lambda: (2, 27, 0))}), raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "FakeGPU")
    rc, out, err = run("bench", "--json", str(tmp_path / "r.json"))
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("# fastcomm all-reduce benchmark, 2 ranks") and lines[1].startswith("#        size")
    assert lines[2] == B.table_row(row, 2) and lines.count(B.table_row(row, 2)) == 1
    assert f"wrote {tmp_path / 'r.json'}" in out and f"wrote {tmp_path / 'r.png'}" in out
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == [row]


def test_compile_without_the_nvrtc_library_is_one_line(run, monkeypatch, tmp_path):
    # CuPy installed beside a CPU-only torch: CuPy's binding is there, libnvrtc is not.
    def missing(*a, **k):
        raise RuntimeError('Failure finding "libnvrtc.so.13 or libnvrtc.so.12": No such file')
    monkeypatch.setattr(jit, "cached_cubin", missing)
    monkeypatch.setattr(A, "cupy_missing", lambda: None)
    rc, _, err = run("compile", "--arch", "sm_90", "--cache-dir", str(tmp_path))
    line = one_line(err)
    assert rc == 1 and "the NVRTC library is missing" in line and "nvidia-cuda-nvrtc" in line


def test_bench_checks_the_settings_of_every_workspace_it_will_build(run, no_gpus):
    rc, _, err = run("bench", "--transports", "p2p,host", "--host-workspace-bytes", "512K",
                     env={"FASTCOMM_ONE_SHOT_MAX_BYTES": "1M"})
    assert rc == 2 and "FASTCOMM_ONE_SHOT_MAX_BYTES" in one_line(err) and "524288" in one_line(err)


@pytest.mark.parametrize("env, name", [({"FASTCOMM_MAX_BYTES": "8Q"}, "FASTCOMM_MAX_BYTES"),
                                       ({"FASTCOMM_TIMEOUT_S": "-1"}, "FASTCOMM_TIMEOUT_S")])
def test_bench_names_a_bad_setting_in_one_line(run, no_gpus, env, name):
    # FASTCOMM_MAX_BYTES is overridden by the run's own workspace sizes, but a typo in it is still reported.
    rc, _, err = run("bench", env=env)
    assert rc == 2 and name in one_line(err) and "Traceback" not in err


# ---- fastcomm compile: every compile unit -------------------------------------------------------------

@pytest.fixture
def unit_compile(monkeypatch):
    """jit.cached_cubin stand-in that records (arch, unit) and writes ``unit_compile.data`` (a stub ELF unless a
    test sets a real cubin) under each unit's own name, as jit names them."""
    calls = []

    def fake(arch, cache_dir, *a, unit="comm", **k):
        calls.append((arch, unit))
        path = Path(cache_dir) / (f"fastcomm-{arch}.cubin" if unit == "comm" else f"fastcomm-{unit}-{arch}.cubin")
        path.write_bytes(fake.data)
        return path
    fake.data = b"\x7fELF"
    fake.calls = calls
    monkeypatch.setattr(jit, "cached_cubin", fake)
    monkeypatch.setattr(A, "cupy_missing", lambda: None)
    return fake


def test_compile_builds_every_unit_unless_told(run, unit_compile, tmp_path):
    rc, out, err = run("compile", "--arch", "sm_90", "--cache-dir", str(tmp_path))
    assert rc == 0 and not err and unit_compile.calls == [("sm_90", "comm"), ("sm_90", "kquant")]
    heads = [line for line in out.splitlines() if not line.startswith(" ")]
    assert [h.split(" ", 2)[:2] for h in heads] == [["sm_90:", "comm:"], ["sm_90:", "kquant:"]]
    assert f"{tmp_path / 'fastcomm-kquant-sm_90.cubin'} (4 bytes, " in heads[1]

    unit_compile.calls.clear()
    rc, out, err = run("compile", "--arch", "sm_90", "--unit", "kquant", "-q", "--cache-dir", str(tmp_path))
    assert rc == 0 and not err and unit_compile.calls == [("sm_90", "kquant")]
    assert out.startswith("sm_90: kquant: ") and ": comm: " not in out

    unit_compile.calls.clear()  # in the order given, each once, for each arch in turn
    rc, _, _ = run("compile", "--arch", "sm_80", "--arch", "sm_120", "--unit", "kquant", "--unit", "comm",
                   "--unit", "kquant", "--cache-dir", str(tmp_path))
    assert rc == 0 and unit_compile.calls == [("sm_80", "kquant"), ("sm_80", "comm"),
                                              ("sm_120", "kquant"), ("sm_120", "comm")]


def test_compile_refuses_an_unknown_unit_in_one_line(run, unit_compile, tmp_path):
    rc, _, err = run("compile", "--unit", "nccl", "--cache-dir", str(tmp_path))
    line = one_line(err)
    assert rc == 2 and "--unit" in line and "'nccl'" in line and "comm" in line and "kquant" in line
    assert not unit_compile.calls


def test_compile_names_the_unit_that_failed(run, unit_compile, monkeypatch, tmp_path):
    fake = unit_compile

    def kquant_fails(arch, cache_dir, *a, unit="comm", **k):
        if unit == "kquant":
            raise jit.CompileError(f"NVRTC failed for {arch}: NVRTC_ERROR_COMPILATION (6)\nkquant.cu(1): error")
        return fake(arch, cache_dir, unit=unit)
    monkeypatch.setattr(jit, "cached_cubin", kquant_fails)
    rc, out, err = run("compile", "--arch", "sm_90", "--cache-dir", str(tmp_path))
    assert rc == 1 and out.startswith("sm_90: comm: ")
    first, *log = err.splitlines()
    assert first.startswith("fastcomm compile: kquant: NVRTC failed for sm_90") and log == ["kquant.cu(1): error"]


def test_compile_reports_each_units_kernels(run, unit_compile, tmp_path):
    """Both units' lines, each with its resource table (the tiny cubin of tests/test_cubin.py stands in for
    both, so nothing of fastcomm is compiled), or with -q only its line and warning."""
    from tests.test_cubin import tiny_cubin  # skips where NVRTC is missing

    unit_compile.data = tiny_cubin("sm_90")
    rc, out, err = run("compile", "--arch", "sm_90", "--cache-dir", str(tmp_path))
    assert rc == 0 and not err
    lines = out.splitlines()
    assert len(lines) == 12 and lines[0].startswith("sm_90: comm: ") and lines[6].startswith("sm_90: kquant: ")
    for block in (lines[1:6], lines[7:12]):
        assert block[0].startswith("  sm_90 limits: ") and block[1].split()[0] == "kernel"
        assert [row.split()[0] for row in block[2:4]] == ["tiny_bounded", "tiny_local"]
        assert block[4].startswith("  warning: 1 of 2 kernels use local memory")

    rc, out, _ = run("compile", "--arch", "sm_90", "-q", "--cache-dir", str(tmp_path))
    quiet = out.splitlines()
    assert rc == 0 and len(quiet) == 4 and quiet[1] == quiet[3] == lines[5]
    assert quiet[0].startswith("sm_90: comm: ") and quiet[2].startswith("sm_90: kquant: ")


def test_compile_notice_names_the_kquant_unit(monkeypatch, tmp_path, capsys):
    def slow(arch, cache_dir, *a, **k):
        time.sleep(1.0)
        return tmp_path / "x.cubin"
    monkeypatch.setattr(jit, "cached_cubin", slow)
    A.compile_with_notice("sm_120", tmp_path, unit="kquant")
    assert capsys.readouterr().err == "compiling kquant kernels for sm_120 (first use, about 20 s)...\n"
