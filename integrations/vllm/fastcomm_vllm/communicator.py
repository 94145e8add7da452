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
"""
from __future__ import annotations

import importlib.util
import logging

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

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
        self.fastcomm_workspace = None
        self.fastcomm_why_not: str | None = "not a tensor-parallel group of 2+ ranks"
        if self.unique_name.split(":")[0] == "tp" and self.world_size >= 2 \
                and isinstance(self.cpu_group, dist.ProcessGroup):
            self.fastcomm_workspace, self.fastcomm_why_not = self._open_workspace()
        self._fastcomm_try = None
        if self.fastcomm_workspace is not None:
            import fastcomm

            self._fastcomm_try = fastcomm.try_all_reduce

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        ws = self.fastcomm_workspace
        if ws is None:
            return super().all_reduce(input_)
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
                from fastcomm.commands.args import CUPY_HINT

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
