"""vLLM's CUDA communicator with fastcomm in front of its all-reduce.

Only tensor-parallel groups of 2+ ranks on one node get a workspace. Every decision is the same on every
rank: whether to build the workspace is agreed over the group (a rank that cannot build it makes all of
them fall back), and per call the routing depends only on shape, dtype and layout, which all ranks share.

Graph capture (vLLM captures more than once, the first time only to measure memory): fastcomm copies the
input into its own persistent buffers and keeps its sequence state on the device, so a captured call needs
no registration and a graph replays correctly however many graphs were captured or thrown away before.

A device-side timeout kills the CUDA context, and what reaches vLLM is CUDA's generic launch failure, at
whichever call next touches the device. Two things turn it into fastcomm's message naming rank, peer and
step: ``all_reduce`` re-raises such a RuntimeError as ``fastcomm.translate_error``'s FastcommTimeoutError,
and the workspace's watcher logs the message through vLLM's logger the moment the kernel records it, for
failures that surface elsewhere (a CUDA-graph replay, the sampler's sync).

Start-up skew: ranks reach their first all-reduces minutes apart (torch.compile, warm-up, a slow load on one
rank), far past FASTCOMM_TIMEOUT_S, which bounds a kernel's wait for its peers. Until the worker's warm-up
(``compile_or_warm_up_model``) has returned, every eager all-reduce therefore first meets its peers at a
barrier on the group's CPU (gloo) group, whose timeout is vLLM's distributed timeout, so a kernel starts only
when every rank has arrived. Captures launch nothing and replays run no Python: neither pays for it, nor
does any call after warm-up.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import sys
import weakref

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

from . import watchdog

logger = logging.getLogger("vllm.fastcomm")


def raise_translated(exc: RuntimeError) -> None:
    """Raise fastcomm's FastcommTimeoutError (rank, peer, step) in place of ``exc`` when a workspace of this
    process recorded a device-side timeout; return when none did (``exc`` is then someone else's error)."""
    import fastcomm

    if isinstance(exc, fastcomm.FastcommError):
        return  # fastcomm's own, already in its words
    translated = fastcomm.translate_error(exc)
    if translated is not None:
        raise translated from exc


class FastcommCudaCommunicator(CudaCommunicator):
    """``all_reduce`` goes to fastcomm when its policy accepts the tensor, to vLLM's chain otherwise."""

    def __init__(self, *args, **kwargs):
        # vLLM 0.33 passes use_all2all, 0.25 does not: forward whatever this vLLM gives.
        super().__init__(*args, **kwargs)
        self._open_fastcomm()

    def _open_fastcomm(self) -> None:
        self.fastcomm_ready = False  # set when the worker's warm-up returns (see the module text)
        self.fastcomm_workspace = None
        self.fastcomm_why_not: str | None = "not a tensor-parallel group of 2+ ranks"
        if self.unique_name.split(":")[0] == "tp" and self.world_size >= 2 \
                and isinstance(self.cpu_group, dist.ProcessGroup):
            self.fastcomm_workspace, self.fastcomm_why_not = self._open_workspace()
        self._fastcomm_try = None
        if self.unique_name.split(":")[0] == "tp":
            watchdog.install_in_vllm(getattr(self, "global_rank", self.rank))  # the stall guard, once a process
        if self.fastcomm_workspace is not None:
            import fastcomm

            self._fastcomm_try = fastcomm.try_all_reduce
            _OPEN.add(self)
            _mark_ready_after_warm_up()

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        ws = self.fastcomm_workspace
        if ws is None:
            return super().all_reduce(input_)
        if not self.fastcomm_ready and input_.is_cuda and not torch.cuda.is_current_stream_capturing():
            dist.barrier(group=self.cpu_group)  # start-up: meet the peers on the host first
        watchdog.PROGRESS.family = "fastcomm all-reduce"
        try:
            out = self._fastcomm_try(input_, ws)  # None: fastcomm's policy declines, on every rank alike
            return out if out is not None else super().all_reduce(input_)
        except RuntimeError as exc:
            raise_translated(exc)
            raise

    def destroy(self) -> None:
        ws, self.fastcomm_workspace = self.fastcomm_workspace, None
        if ws is not None:
            ws.close()
        super().destroy()

    # ---- construction ---------------------------------------------------------------------------------

    def _open_workspace(self):
        """(workspace, None), or (None, why). fastcomm's own failures do not raise: vLLM keeps its path.

        Runs the same collectives on every rank whatever the local outcome, so a rank that fails early
        cannot leave the others waiting.
        """
        from vllm.distributed.parallel_state import in_the_same_node_as

        reason = self._local_reason()
        if not all(in_the_same_node_as(self.cpu_group, source_rank=0)) and reason is None:
            reason = "the group spans more than one node"
        if not self._all_ranks_agree(reason is None):
            return None, self._fall_back(reason or "another rank cannot build a fastcomm workspace")

        ws = None
        try:
            import fastcomm

            ws = fastcomm.Workspace(self.cpu_group, self.device)
        except Exception as e:  # the workspace raises collectively for shared causes; agree anyway
            reason = f"{type(e).__name__}: {e}"
        if not self._all_ranks_agree(ws is not None):
            if ws is not None:
                ws.close()
            return None, self._fall_back(reason or "another rank failed to build its workspace")
        ws.watch(logger.error)  # a device-side timeout is logged by vLLM's logger wherever it surfaces
        if self.rank_in_group == 0:
            logger.info("%s (vLLM group %s)", ws.describe(), self.unique_name)
        return ws, None

    def _local_reason(self) -> str | None:
        """Why this rank cannot take part, from local facts only (no collective)."""
        if self.device.type != "cuda":
            return f"device {self.device} is not CUDA"
        for module in ("fastcomm", "cupy"):
            if importlib.util.find_spec(module) is None:
                from fastcomm.runtime.jit import CUPY_HINT

                return f"{module} is not installed ({CUPY_HINT})"
        try:
            import fastcomm

            fastcomm.Config.from_env()
            fastcomm.Workspace  # noqa: B018 -- the core must be importable before anyone starts collectives
        except Exception as e:
            return f"fastcomm is unusable here: {type(e).__name__}: {e}"
        return None

    def _all_ranks_agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return bool(flag.item())

    def _fall_back(self, reason: str) -> str:
        logger.warning("fastcomm: group %s rank %d: no workspace (%s); using vLLM's all-reduce",
                       self.unique_name, self.rank_in_group, reason)
        return reason


_OPEN: "weakref.WeakSet[FastcommCudaCommunicator]" = weakref.WeakSet()


def _mark_ready_after_warm_up() -> None:
    """Wrap the worker's ``compile_or_warm_up_model`` (vLLM 0.25 and newer) so that, once it returns, this
    process's communicators stop meeting at start-up barriers. Idempotent."""
    module = sys.modules.get("vllm.v1.worker.gpu_worker")
    worker = getattr(module, "Worker", None)
    original = getattr(worker, "compile_or_warm_up_model", None)
    if original is None:
        logger.warning("fastcomm: vLLM's Worker.compile_or_warm_up_model not found; all-reduces keep meeting "
                       "at a CPU barrier before each eager call")
        return
    if getattr(original, "_fastcomm", False):
        return

    @functools.wraps(original)
    def compile_or_warm_up_model(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        for comm in list(_OPEN):
            comm.fastcomm_ready = True
        return out

    compile_or_warm_up_model._fastcomm = True
    worker.compile_or_warm_up_model = compile_or_warm_up_model
