"""jit.cached_cubin: ranks that start together build each cubin once (the cache entry's lock), and a rank that
waits past the bound builds it itself. No NVRTC needed: the compile is a stand-in that records each call."""
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import os, sys, time, types
    sys.path.insert(0, {root!r})
    from fastcomm.runtime import jit
    jit._nvrtc = lambda: types.SimpleNamespace(getVersion=lambda: (13, 0))
    jit._takes_split_compile = lambda: True
    def slow(arch, options, unit):
        with open({log!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        time.sleep({seconds})
        return b"\\x7fELF" + arch.encode()
    jit.compile_cubin = slow
    jit.LOCK_WAIT_S = {wait}
    print(jit.cached_cubin("sm_90", {cache!r}))
""")


def start(tmp_path, n, seconds, wait):
    code = CHILD.format(root=str(ROOT), log=str(tmp_path / "compiles.log"), seconds=seconds, wait=wait,
                        cache=str(tmp_path / "cache"))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(n)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return outs, (tmp_path / "compiles.log").read_text().split()


def test_ranks_starting_together_share_one_build(tmp_path):
    paths, compiles = start(tmp_path, 4, seconds=2.0, wait=60)
    assert len(compiles) == 1, compiles                     # one rank compiled ...
    assert len(set(paths)) == 1 and Path(paths[0]).read_bytes() == b"\x7fELFsm_90"  # ... all load its file


def test_a_wait_past_the_bound_builds_here(tmp_path):
    paths, compiles = start(tmp_path, 2, seconds=3.0, wait=0.5)
    assert len(compiles) == 2 and len(set(paths)) == 1       # duplicated, never wrong
    assert Path(paths[0]).read_bytes() == b"\x7fELFsm_90"
