"""fastcomm.cubin reads each kernel's registers, static shared memory, stack frame and launch bound from a cubin,
and `fastcomm compile` prints them against the architecture's limits. No GPU; the ELF tests need CuPy (NVRTC)
and compile a few-line kernel, not a fastcomm unit."""
from __future__ import annotations

import re
import shutil
import struct
import subprocess

import pytest

from fastcomm.runtime import cubin
from fastcomm import commands as cli
from fastcomm.runtime import jit
from fastcomm.commands.compile import resource_lines
from fastcomm.runtime.cubin import KernelResources

TINY = r"""
extern "C" __global__ void __launch_bounds__(128) tiny_bounded(float* out) {
  __shared__ float tile[1024];  // 4096 bytes of static shared memory
  tile[threadIdx.x] = out[threadIdx.x];
  __syncthreads();
  out[threadIdx.x] = tile[(threadIdx.x + 1) % 128];
}
extern "C" __global__ void tiny_local(float* out, int n) {
  float a[256];  // indexed at run time, so it lives in the stack frame
  for (int i = 0; i < 256; ++i) a[i] = out[i * n];
  out[threadIdx.x] = a[(threadIdx.x * 7 + n) & 255];
}
"""
_built: dict[str, bytes] = {}


def tiny_cubin(arch: str) -> bytes:
    from nvrtc_probe import why_no_nvrtc

    if why_no_nvrtc():
        pytest.skip(why_no_nvrtc())
    from cupy_backends.cuda.libs import nvrtc
    if arch not in _built:
        prog = nvrtc.createProgram(TINY, "tiny.cu", [], [])
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *jit.OPTIONS])
            _built[arch] = nvrtc.getCUBIN(prog)
        finally:
            nvrtc.destroyProgram(prog)
    return _built[arch]


def cuobjdump_res_usage(data: bytes, tmp_path) -> dict[str, dict[str, int]]:
    """cuobjdump -res-usage per kernel. CuPy's getCUBIN drops the last byte, which cuobjdump refuses: pad the
    file back to the end of its program headers."""
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    path = tmp_path / "tiny.cubin"
    path.write_bytes(data + b"\0" * max(0, phoff + phentsize * phnum - len(data)))
    out = subprocess.run(["cuobjdump", "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    return {name: {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", fields)}
            for name, fields in re.findall(r"Function (\S+):\n\s*(.*)", out)}


@pytest.mark.parametrize("arch", ["sm_80", "sm_120"])
def test_resources_of_a_tiny_kernel(arch, tmp_path):
    data = tiny_cubin(arch)
    got = {k.name: k for k in cubin.resources(data)}
    assert sorted(got) == ["tiny_bounded", "tiny_local"]  # extern "C": names as written
    bounded, local = got["tiny_bounded"], got["tiny_local"]
    # sm_120's .nv.shared section holds 5120 bytes (the 1 KB block reserve counted in); the array is 4096
    assert bounded.shared_bytes == 4096 and bounded.max_threads == 128 and bounded.local_bytes == 0
    assert local.shared_bytes == 0 and local.max_threads is None and local.local_bytes >= 1024
    assert all(0 < k.registers <= 255 for k in got.values())
    if arch == "sm_80":  # sm_80's .text.<kernel> sh_info also carries the count, in its top byte
        texts = {s[0]: s[5] >> 24 for s in cubin._sections(data) if s[0].startswith(".text.")}
        assert {n: k.registers for n, k in got.items()} == {n[len(".text."):]: r for n, r in texts.items()}
    if shutil.which("cuobjdump") is None:
        pytest.skip("cuobjdump not on PATH: the comparison with it is skipped")
    truth = cuobjdump_res_usage(data, tmp_path)
    reserve = 1024 if arch != "sm_80" else 0  # cuobjdump prints the section size, reserve included
    for name, k in got.items():
        assert truth[name]["REG"] == k.registers and truth[name]["STACK"] == k.local_bytes, name
        # a kernel without shared memory may have no section (0) or one holding only the reserve
        assert truth[name]["SHARED"] in ((k.shared_bytes + reserve,) if k.shared_bytes else (0, reserve)), name


def test_compile_prints_the_kernels_of_the_cubin(monkeypatch, capsys, tmp_path):
    data = tiny_cubin("sm_120")

    def cached(arch, cache_dir, *a, **k):  # the tiny cubin stands in for the comm unit
        path = tmp_path / f"fastcomm-{arch}.cubin"
        path.write_bytes(data)
        return path
    monkeypatch.setattr(jit, "cached_cubin", cached)
    regs = {k.name: k.registers for k in cubin.resources(data)}

    assert cli.main(["compile", "--arch", "sm_120", "--unit", "comm", "--cache-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert not err and lines[0].startswith("sm_120: ") and "sm_120 limits: 101376 bytes" in lines[1]
    assert lines[2].split() == ["kernel", "regs", "smem/blk", "local/thr", "bound"]
    assert lines[3].split() == ["tiny_bounded", str(regs["tiny_bounded"]), "4096", "0", "128"]
    assert lines[4].split()[:3] == ["tiny_local", str(regs["tiny_local"]), "0"] and lines[4].split()[4] == "-"
    assert lines[5].startswith("  warning: 1 of 2 kernels use local memory") and "(tiny_local)" in lines[5]
    assert len(lines) == 6

    assert cli.main(["compile", "--arch", "sm_120", "--unit", "comm", "--cache-dir", str(tmp_path), "--quiet"]) == 0
    quiet = capsys.readouterr().out.splitlines()
    assert len(quiet) == 2 and quiet[0].startswith("sm_120: ") and quiet[1] == lines[5]


# ---- the formatting, on plain values ------------------------------------------------------------------

BIG = KernelResources("fc_big", registers=40, shared_bytes=101377, local_bytes=0, max_threads=256)
SPILL = KernelResources("fc_spill", registers=255, shared_bytes=0, local_bytes=96)
PLAIN = KernelResources("fc_plain", registers=32, shared_bytes=1024, local_bytes=0, max_threads=1024)


def test_warnings_against_each_architecture():
    assert cubin.warnings([BIG, PLAIN], "sm_120") == [
        "warning: fc_big: 101377 bytes of static shared memory, over sm_120's 101376 per block"]
    assert cubin.warnings([BIG, PLAIN], "sm_90") == cubin.warnings([BIG], "sm_90a") == []
    assert cubin.warnings([BIG, SPILL, PLAIN], "sm_86") == [  # not in the table: only the spill is judged
        "warning: 1 of 3 kernels use local memory (register spills or local arrays), up to 96 bytes per thread "
        "(fc_spill)"]
    assert cubin.limits_line("sm_86") is None and cubin.limits_for("sm_120a") == cubin.LIMITS["sm_120"]


def test_table_and_quiet_lines():
    rows = cubin.table([PLAIN, SPILL])
    assert [r.split() for r in rows] == [["kernel", "regs", "smem/blk", "local/thr", "bound"],
                                         ["fc_plain", "32", "1024", "0", "1024"],
                                         ["fc_spill", "255", "0", "96", "-"]]
    assert len({len(r) for r in rows}) == 1  # aligned


def test_an_unreadable_cubin_is_one_line():
    assert resource_lines("sm_90", b"\x7fELF") == ["kernel resources: not a 64-bit little-endian ELF (a cubin)"]
    with pytest.raises(ValueError, match="unreadable cubin"):
        cubin.resources(b"\x7fELF\x02\x01" + b"\0" * 58 + b"\xff" * 8)
