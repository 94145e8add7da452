"""The serving stall guard (fastcomm_vllm.watchdog): a model step that stops returning ends the worker with
one line naming rank, step and the last kernel family, instead of spinning."""
import os
import subprocess
import sys
import textwrap

import pytest

from fastcomm_vllm import watchdog


def test_stalled_only_after_warm_up_and_past_the_limit():
    p = watchdog.Progress(step=4, call="execute_model", since=100.0, family="CUDA graph replay")
    assert not watchdog.stalled(p, 200.0, 30)  # warm-up not over
    p.armed = True
    assert not watchdog.stalled(p, 129.0, 30) and watchdog.stalled(p, 130.0, 30)
    assert not watchdog.stalled(p, 1e9, 0)  # off
    p.since = None
    assert not watchdog.stalled(p, 1e9, 30)  # no call running: idle is no stall
    p.since = 100.0
    msg = watchdog.message(5, p, 161.0, 60)
    assert "rank 5" in msg and "model step 4" in msg and "61 s" in msg and "execute_model" in msg
    assert "CUDA graph replay" in msg and "FASTCOMM_VLLM_STALL_S=60" in msg and "\n" not in msg


GUARDED_WORKER = """
import sys, time
from fastcomm_vllm import watchdog

class Worker:
    def compile_or_warm_up_model(self):
        time.sleep(WARM)  # long warm-up: not guarded
    def execute_model(self, seconds):
        watchdog.launched("fastcomm all-reduce")
        time.sleep(seconds)
        return "done"
    def sample_tokens(self):
        return "sampled"

assert watchdog.install(Worker, 2, LIMIT)
w = Worker()
w.compile_or_warm_up_model()
assert w.execute_model(0) == "done" and w.sample_tokens() == "sampled"
print("step returned", flush=True)
w.execute_model(STEP)
print("not reached", flush=True)
"""


def _run(limit, warm, step):
    code = GUARDED_WORKER.replace("LIMIT", str(limit)).replace("WARM", str(warm)).replace("STEP", str(step))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_a_step_that_never_returns_ends_the_process_with_one_line():
    r = _run(limit=0.5, warm=1.5, step=60)  # warm-up outlasts the limit: still no exit
    assert r.returncode == watchdog.STALL_EXIT, (r.stdout, r.stderr)
    assert "step returned" in r.stdout and "not reached" not in r.stdout
    lines = [line for line in r.stderr.splitlines() if line.startswith("fastcomm: rank 2:")]
    assert len(lines) == 1, r.stderr
    assert "model step 2" in lines[0] and "in execute_model" in lines[0]
    assert "last kernel family launched: fastcomm all-reduce" in lines[0]


def test_steps_within_the_limit_run_on():
    code = GUARDED_WORKER.replace("LIMIT", "2").replace("WARM", "0").replace("STEP", "0.2")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "not reached" in r.stdout, r.stderr


def test_off_and_idempotent():
    class Worker:
        def compile_or_warm_up_model(self):
            pass

        def execute_model(self):
            pass

    assert not watchdog.install(Worker, 0, 0)  # FASTCOMM_VLLM_STALL_S=0
    assert not getattr(Worker.execute_model, "_fastcomm_guard", False)
    exits = []
    assert watchdog.install(Worker, 0, 1000, exit=exits.append)
    wrapped = Worker.execute_model
    assert watchdog.install(Worker, 0, 1000, exit=exits.append)
    assert Worker.execute_model is wrapped and not exits


@pytest.mark.vllm
def test_the_vllm_methods_it_guards_exist():
    pytest.importorskip("vllm.config")
    code = textwrap.dedent("""
        import vllm.v1.worker.gpu_worker as gw
        from vllm.compilation.cuda_graph import CUDAGraphWrapper
        from fastcomm_vllm import watchdog
        watchdog.install_in_vllm(0)
        names = ("execute_model", "sample_tokens", "compile_or_warm_up_model")
        print([getattr(getattr(gw.Worker, n), "_fastcomm_guard", False) for n in names],
              getattr(CUDAGraphWrapper.__call__, "_fastcomm_guard", False))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTCOMM_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[-2] == "[True, True, True] True", r.stdout
