"""Stall guard for serving: a worker whose model step stops making progress exits instead of spinning.

fastcomm's own waits are bounded (FASTCOMM_TIMEOUT_S), but the rest of a decode step is not: an attention
kernel that livelocks (reported for FlashInfer's sm_120 sparse MLA under sustained load) keeps the GPUs at
100 % with no output, and the server never notices. Every call of the worker's ``execute_model`` and
``sample_tokens`` is timed (a CUDA-graph replay or an eager step blocks in one of them once the GPU stops
finishing work); one that has not returned after FASTCOMM_VLLM_STALL_S, once warm-up is over, is logged in
one line naming rank, step, the call and the kernel family last launched from the host, and the process
exits with STALL_EXIT. vLLM's executor sees its worker die and shuts the engine down, so ``vllm serve``
exits non-zero. Warm-up (torch.compile, graph capture) is not guarded: its length depends on the machine.

"Last launched" is what the host last started: inside a CUDA graph that is the replay as a whole.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import threading
import time
from typing import Callable

logger = logging.getLogger("vllm.fastcomm")

STALL_EXIT = 3
GUARDED = ("execute_model", "sample_tokens")


@dataclasses.dataclass
class Progress:
    """What the guarded calls record; read by the guard's thread (plain attribute writes: no lock needed)."""
    step: int = 0                    # execute_model calls after warm-up
    call: str | None = None          # the guarded call running now (None: none)
    since: float | None = None       # when it started (monotonic)
    family: str = "none yet"         # the kernel family last launched from the host
    armed: bool = False              # warm-up is over


PROGRESS = Progress()


def launched(family: str) -> None:
    """Record the kernel family the host is launching (cheap: one attribute write)."""
    PROGRESS.family = family


def stalled(p: Progress, now: float, limit_s: float) -> bool:
    return p.armed and limit_s > 0 and p.since is not None and now - p.since >= limit_s


def message(rank: int, p: Progress, now: float, limit_s: float) -> str:
    return (f"fastcomm: rank {rank}: model step {p.step} has made no progress for {now - p.since:.0f} s (in "
            f"{p.call}; last kernel family launched: {p.family}); exiting with status {STALL_EXIT} so the server "
            f"stops instead of spinning (FASTCOMM_VLLM_STALL_S={limit_s:g}, 0 turns this off)")


def _guarded(original: Callable, name: str) -> Callable:
    @functools.wraps(original)
    def call(self, *args, **kwargs):
        p = PROGRESS
        if name == "execute_model" and p.armed:
            p.step += 1
        p.call, p.since = name, time.monotonic()
        try:
            return original(self, *args, **kwargs)
        finally:
            p.call, p.since = None, None

    call._fastcomm_guard = True
    return call


def _arming(original: Callable) -> Callable:
    @functools.wraps(original)
    def compile_or_warm_up_model(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        PROGRESS.armed = True
        return out

    compile_or_warm_up_model._fastcomm_guard = True
    return compile_or_warm_up_model


def _replays(original: Callable) -> Callable:
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        PROGRESS.family = "CUDA graph replay"
        return original(self, *args, **kwargs)

    __call__._fastcomm_guard = True
    return __call__


def _wrap(cls, name: str, make: Callable) -> bool:
    original = getattr(cls, name, None)
    if original is None:
        return False
    if not getattr(original, "_fastcomm_guard", False):
        setattr(cls, name, make(original))
    return True


_STARTED: dict[int, threading.Thread] = {}


def install(worker_cls, rank: int, limit_s: float, *, graph_wrapper_cls=None,
            exit: Callable[[int], None] = os._exit, clock: Callable[[], float] = time.monotonic) -> bool:
    """Guard ``worker_cls``'s model calls in this process (idempotent); False where it has none to guard or
    ``limit_s`` is 0."""
    if limit_s <= 0:
        return False
    found = [_wrap(worker_cls, name, functools.partial(_guarded, name=name)) for name in GUARDED]
    if not any(found) or not _wrap(worker_cls, "compile_or_warm_up_model", _arming):
        logger.warning("fastcomm: vLLM's Worker has no %s / compile_or_warm_up_model; no stall guard",
                       "/".join(GUARDED))
        return False
    if graph_wrapper_cls is not None:
        _wrap(graph_wrapper_cls, "__call__", _replays)
    if os.getpid() in _STARTED:
        return True
    period = max(0.02, min(limit_s / 4, 5.0))

    def watch():
        while True:
            time.sleep(period)
            now = clock()
            if stalled(PROGRESS, now, limit_s):
                text = message(rank, PROGRESS, now, limit_s)
                if logger.hasHandlers():  # vLLM's handlers: the server's log
                    logger.error(text)
                    node = logger
                    while node is not None:  # before os._exit, which flushes nothing
                        for handler in node.handlers:
                            handler.flush()
                        node = node.parent
                else:
                    print(text, file=sys.stderr, flush=True)
                exit(STALL_EXIT)
                return

    thread = threading.Thread(target=watch, name="fastcomm-stall-guard", daemon=True)
    _STARTED[os.getpid()] = thread
    thread.start()
    return True


def install_in_vllm(rank: int) -> None:
    """The guard on vLLM's GPU worker, from FASTCOMM_VLLM_STALL_S (called in each worker process)."""
    from fastcomm.config import Config

    module = sys.modules.get("vllm.v1.worker.gpu_worker")
    worker = getattr(module, "Worker", None)
    if worker is None:
        return
    try:
        from vllm.compilation.cuda_graph import CUDAGraphWrapper
    except ImportError:
        CUDAGraphWrapper = None
    install(worker, rank, Config.from_env().vllm_stall_s, graph_wrapper_cls=CUDAGraphWrapper)
