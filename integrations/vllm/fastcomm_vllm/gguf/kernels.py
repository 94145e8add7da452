"""Does vllm-gguf-plugin's CUDA extension load here, or will it fall back to Triton?

The plugin imports its extension inside ``try`` and, when that fails, silently runs its Triton kernels
(measured 80 us for one 6144 x 2048 Q4_0 GEMV on an H200, against ~3 us of weight bandwidth). The prebuilt
wheel's extension is built for one torch; under another (e.g. vLLM 0.25.0's torch 2.11) it fails with an
undefined symbol. This loads the extension file directly, without importing the plugin (and vLLM).
"""
from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

EXTENSION = "_C_gguf"
PACKAGE = "vllm_gguf_plugin"


@dataclasses.dataclass(frozen=True)
class KernelStatus:
    cuda: bool          # the plugin will run its CUDA kernels
    detail: str         # why not, or where they come from

    def warning(self) -> str | None:
        if self.cuda:
            return None
        return (f"vllm-gguf-plugin will run its slow Triton fallback, not its CUDA kernels ({self.detail}); "
                "a K-quant GEMV is ~25x slower. Build the extension for this torch: "
                "pip install --no-build-isolation --no-binary vllm-gguf-plugin vllm-gguf-plugin "
                "(bench/device_gguf.sh shows it offline)")


def status() -> KernelStatus:
    if os.environ.get("VLLM_GGUF_USE_CUDA", "1") != "1":
        return KernelStatus(False, "VLLM_GGUF_USE_CUDA is not 1")
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return KernelStatus(False, f"{PACKAGE} is not installed")
    folder = Path(list(spec.submodule_search_locations)[0])
    found = sorted(folder.glob(f"{EXTENSION}*.so"))
    if not found:
        return KernelStatus(False, f"no {EXTENSION}*.so in {folder} (installed without its CUDA extension)")
    name = f"{PACKAGE}.{EXTENSION}"
    if name in sys.modules:
        return KernelStatus(True, f"{found[0].name} is loaded")
    try:
        import torch  # noqa: F401  (the extension links against libtorch, which torch's import loads)

        loader = importlib.machinery.ExtensionFileLoader(name, str(found[0]))
        ext_spec = importlib.util.spec_from_file_location(name, found[0], loader=loader)
        module = importlib.util.module_from_spec(ext_spec)
        loader.exec_module(module)
        # Registered under its own name: the plugin's later `from . import _C_gguf` takes this module
        # instead of initializing the extension (and its torch op library) a second time.
        sys.modules[name] = module
    except (ImportError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return KernelStatus(False, f"{found[0].name} does not load: {first}")
    return KernelStatus(True, f"{found[0].name} loads")
