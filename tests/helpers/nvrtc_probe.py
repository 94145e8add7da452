"""Why kernels cannot be compiled here, or None: CuPy's NVRTC binding and the NVRTC library it loads.

CuPy installs beside a CPU-only torch without libnvrtc (its binding imports, the first compile fails), so the
compile tests skip with the reason and the fix rather than fail."""
import functools


@functools.lru_cache(maxsize=None)
def why_no_nvrtc() -> str | None:
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError:
        return 'CuPy (NVRTC) not installed: pip install -e ".[cuda13]" (or cuda12)'
    try:
        nvrtc.getVersion()
    except Exception as e:  # CuPy raises RuntimeError where libnvrtc.so is not found
        return (f"the NVRTC library does not load ({str(e).splitlines()[0][:120]}): "
                'pip install "nvidia-cuda-nvrtc>=13,<14" (the cuda13 extra brings it)')
    return None
