"""Why kernels cannot be compiled here, or None (fastcomm.jit.nvrtc_problem, asked once per test run).

CuPy installs beside a CPU-only torch without libnvrtc (its binding imports, the first compile fails), so the
compile tests skip with the reason and the fix rather than fail."""
import functools


@functools.lru_cache(maxsize=None)
def why_no_nvrtc() -> str | None:
    from fastcomm.runtime import jit

    return jit.nvrtc_problem()
