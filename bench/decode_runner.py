"""bench-decode's runner: one subprocess per backend (``decode_worker``), killed with its children at a timeout.

Each backend gets its own process because vLLM's configuration (custom all-reduce, the plugin's variables)
is fixed at start-up, and a fresh process per row keeps one row's state out of the next.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .decode_backends import Backend, row_env

INSTALL = 'from a checkout: pip install -e ".[vllm]"'


def why_not_runnable(fastcomm_rows: bool) -> str | None:
    """Why this environment cannot run the benchmark (no vLLM; fastcomm rows without the plugin), or None."""
    spec = importlib.util.find_spec("vllm")
    # A folder named vllm without __init__.py (a namespace package, say tests/vllm) is not vLLM.
    if spec is None or spec.origin in (None, "namespace"):
        return f"vLLM is not installed in this environment ({INSTALL})"
    if fastcomm_rows and "fastcomm" not in {ep.name for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}:
        return f"fastcomm's vLLM plugin is not registered in this environment, so vLLM's workers would not load it ({INSTALL})"
    return None


def run_backend(backend: Backend, spec: dict, log_dir: Path, timeout: float, tag: str = "") -> dict:
    """One row: the worker's result file (complete or cut short) plus how the process ended."""
    spec_file = log_dir / "spec.json"
    spec_file.write_text(json.dumps(spec))
    result_file = log_dir / f"{backend.name}{tag}.result.json"
    result_file.unlink(missing_ok=True)
    log = log_dir / f"{backend.name}{tag}.log"
    # status RPC: collective_rpc ships worker_status by reference (cloudpickle), which vLLM gates on this.
    env_set = row_env(backend, spec)
    env = {**os.environ, **env_set, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", f"{__package__}.decode_worker", backend.name, str(spec_file), str(result_file)]
    t0 = time.perf_counter()
    with open(log, "w") as out:
        # Own session, so a timeout can stop vLLM's engine and worker processes with it.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    res = {"backend": backend.name, "about": backend.about, "env": env_set,
           "disable_custom_all_reduce": backend.disable_custom_all_reduce, "wall_s": round(time.perf_counter() - t0, 1),
           "log": str(log.relative_to(log_dir.parent))}  # beside the results file, which moves with it
    if result_file.is_file():  # complete, or what a run cut short had measured
        res.update(json.loads(result_file.read_text()))
    res["ok"] = rc == 0 and "sweep" in res
    if not res["ok"]:
        res["error"] = "timed out" if rc is None else f"exit status {rc}"
        res["log_tail"] = log.read_text(errors="replace").splitlines()[-30:]
    return res
