"""Every kernel compiles for sm_80, sm_90 and sm_120 through the same NVRTC path used at run time.

One build of each unit per arch for the whole run: the tests share the run's cubin cache
(conftest.cubin_cache_dir), as ranks share a machine's, so no unit is compiled twice; the cubins marker has
conftest start the builds in the background as the run begins."""
import pytest

from nvrtc_probe import why_no_nvrtc

from fastcomm import abi
from fastcomm.kquant import abi as kabi
from fastcomm.runtime import jit

pytestmark = pytest.mark.skipif(why_no_nvrtc() is not None, reason=why_no_nvrtc() or "")


ARCHS = ["sm_80", "sm_90", "sm_120"]


def builds(unit: str) -> list:
    return [pytest.param(arch, marks=pytest.mark.cubins((unit, arch))) for arch in ARCHS]


@pytest.mark.parametrize("arch", builds("comm"))
def test_kernels_compile(arch, cubin_cache_dir):
    path = jit.cached_cubin(arch, cubin_cache_dir)
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF"
    for kernel in abi.KERNELS:  # every symbol the workspace loads at build
        for sym in kernel.symbols():
            assert sym.encode() in data, f"missing kernel {sym}"
    # second call hits the cache (same file, not recompiled)
    assert jit.cached_cubin(arch, cubin_cache_dir) == path


KQUANT_SYMBOLS = [sym for kernel in kabi.KQ_KERNELS for sym in kernel.symbols()]


@pytest.mark.parametrize("arch", builds("kquant"))
def test_kquant_kernels_compile(arch, cubin_cache_dir):
    """The GGUF decode kernels (csrc/kquant/kquant.cu), a unit of their own: every entry fastcomm.kquant
    launches is in the cubin, cached apart from the communication kernels."""
    path = jit.cached_cubin(arch, cubin_cache_dir, unit="kquant")
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and path.name.startswith("fastcomm-kquant-")
    for sym in KQUANT_SYMBOLS:
        assert sym.encode() in data, f"missing kernel {sym}"
    assert path != jit.cached_cubin(arch, cubin_cache_dir)


def test_cache_key_changes_with_source_and_arch():
    src = {"a.cu": "x"}
    k = jit.cache_key("sm_90", src, ("-O3",), (13, 0))
    assert k != jit.cache_key("sm_80", src, ("-O3",), (13, 0))
    assert k != jit.cache_key("sm_90", {"a.cu": "y"}, ("-O3",), (13, 0))
    assert k != jit.cache_key("sm_90", src, ("-O3",), (12, 8))


def test_compile_errors_carry_the_log(monkeypatch, tmp_path):
    monkeypatch.setattr(jit, "_read_sources", lambda unit="comm": {jit._base(n): ("this is not C++;" if n == jit.ENTRY else "")
                                                              for n in jit.SOURCES})
    with pytest.raises(jit.CompileError, match="sm_90"):
        jit.compile_cubin("sm_90")


def test_builds_optimize_in_parallel_where_nvrtc_takes_it(monkeypatch):
    """This NVRTC takes --split-compile (the kernels' builds use every core), once in the options and the cache
    key; an option NVRTC refuses is left out, not passed to every build."""
    if tuple(jit._nvrtc().getVersion()) >= (13, 0):  # CI's, and the cuda13 extra's
        assert jit.build_options(jit.OPTIONS) == (*jit.OPTIONS, jit.SPLIT_COMPILE)
    assert jit.build_options(jit.build_options(jit.OPTIONS)) == jit.build_options(jit.OPTIONS)
    monkeypatch.setattr(jit, "SPLIT_COMPILE", "--no-such-nvrtc-option")
    jit._takes_split_compile.cache_clear()
    try:
        assert jit.build_options(jit.OPTIONS) == jit.OPTIONS
    finally:
        monkeypatch.undo()
        jit._takes_split_compile.cache_clear()
