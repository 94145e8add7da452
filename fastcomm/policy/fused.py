"""Which fused all-reduce + RMSNorm kernel serves an input: the one-shot one, the two-shot one, or none.

Modelled, not measured (no 4-8 GPU PCIe box lent yet). The one-shot fused op keeps the range it has today
(the one-shot's, ``Plan.fused_max_bytes``): one hop, but each GPU sends W-1 copies of the message. Above
it, at 4 ranks or more, the two-shot fused op (fused_two_shot.cuh) sends about 2 (W-1)/W of the message
per GPU, the same bytes as the unfused two-shot all-reduce that would run there, and saves the norm's
launch and its pass over memory; so it is taken wherever it fits the one-shot buffers, up to 64 tokens
(the range the issue asks for; nothing beyond is modelled). At 2-3 ranks the one-shot sends no more than
twice the two-shot's bytes, and the extra hop is not worth it there: the unfused path stays.
Every input is a pure function of shapes and plan data, so every rank makes the same choice.
"""
from __future__ import annotations

import enum

from ..config import FUSED_CLUSTER_SETTINGS
from ..units import format_size
from .checks import FusedRefusal, FusedWhy, check_fused, check_fused_two_shot

FUSED_TWO_SHOT_MIN_WORLD = 4
FUSED_TWO_SHOT_MAX_TOKENS = 64


class FusedAlgo(str, enum.Enum):
    ONE_SHOT = "one_shot"  # fused_rmsnorm.cuh
    TWO_SHOT = "two_shot"  # fused_two_shot.cuh


def choose_fused(*, tokens: int, hidden: int, elem_size: int, world: int, host: bool, islands: bool,
                 fused_max_bytes: int, one_shot_max_bytes: int, slot_bytes: int, within_policy: bool = True,
                 forced: str = "auto") -> tuple[FusedAlgo | None, str | None]:
    """(kernel, None), or (None, why not).

    ``within_policy`` (routing callers such as the vLLM plugin): only the modelled ranges above. Without it
    (an explicit call of the fused op): the policy's choice where it has one, else whichever kernel can run
    at all (the one-shot's buffers, then the two-shot's). ``forced`` ("one_shot" / "two_shot"): that kernel
    wherever it can run (tests, benchmarks). ``islands``: the plan has islands; the two-shot form is flat only.
    """
    def one_shot(limit: int) -> FusedRefusal | None:
        return check_fused(tokens=tokens, hidden=hidden, elem_size=elem_size, one_shot_max_bytes=limit)

    def two_shot() -> str | None:
        if islands:
            return "the fused two-shot has no island form"
        return check_fused_two_shot(tokens=tokens, hidden=hidden, elem_size=elem_size, world=world, host=host,
                                    slot_bytes=slot_bytes)

    if forced not in ("auto", "one_shot", "two_shot"):
        raise ValueError(f"fused algo must be auto, one_shot or two_shot, not {forced!r}")
    if forced == "one_shot":
        why = one_shot(one_shot_max_bytes)
        return (None, why.message) if why else (FusedAlgo.ONE_SHOT, None)
    if forced == "two_shot":
        why = two_shot()
        return (None, why) if why else (FusedAlgo.TWO_SHOT, None)

    why_one = one_shot(fused_max_bytes)
    if why_one is None:
        return FusedAlgo.ONE_SHOT, None
    why_two = two_shot()
    if why_two is None and world >= FUSED_TWO_SHOT_MIN_WORLD and tokens <= FUSED_TWO_SHOT_MAX_TOKENS:
        return FusedAlgo.TWO_SHOT, None
    if within_policy:
        if why_one.code in (FusedWhy.ROW_TOO_LONG, FusedWhy.EMPTY):  # the shape, not the range: say so as is
            return None, why_one.message
        span = f"the one-shot fused op to {format_size(fused_max_bytes)}"
        if world >= FUSED_TWO_SHOT_MIN_WORLD and not islands:
            span += f", the two-shot one to {FUSED_TWO_SHOT_MAX_TOKENS} tokens within its buffers"
            if why_two and tokens <= FUSED_TWO_SHOT_MAX_TOKENS:
                span += f" ({why_two})"
        return None, f"{tokens} tokens x {hidden} is outside the fused op's range here ({span})"
    if one_shot(one_shot_max_bytes) is None:
        return FusedAlgo.ONE_SHOT, None
    if why_two is None:
        return FusedAlgo.TWO_SHOT, None
    return None, f"{one_shot(one_shot_max_bytes).message}; fused two-shot: {why_two}"




def fused_cluster_form(*, setting: str, cc_major: int, cluster_launch: bool,
                       islands: bool) -> tuple[bool, str | None]:
    """Whether the flat one-shot fused op runs as one thread-block cluster per row (fused_cluster.cuh), and
    why not where ``setting`` is "on" and it cannot.

    Modelled, not measured: the cluster form reads each row once per rank (its chunk per block) where the
    block-per-split form reads it once per block, and swaps partial sums in shared memory, so it is taken
    wherever the device launches clusters (``cluster_launch``: cudaDevAttrClusterLaunch) and is sm_90 or
    newer. It has no island form. Ranks must all choose the same form (the two add a row's sum of squares
    in different orders): every input here is the same on every rank of one GPU model and one setting.
    """
    if setting not in FUSED_CLUSTER_SETTINGS:
        raise ValueError(f"fused cluster setting must be auto, on or off, not {setting!r}")
    if setting == "off":
        return False, None
    why = None
    if islands:
        why = "the cluster form of the fused op has no island form"
    elif cc_major < 9 or not cluster_launch:
        why = f"the device cannot launch thread-block clusters (compute capability {cc_major}.x)"
    if why is None:
        return True, None
    return False, (why if setting == "on" else None)
