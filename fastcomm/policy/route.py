"""One all-reduce's route: the algorithm the plan gives its size, the kernel that runs it, the groups whose
peer tables it takes and its launch shape. The one answer ops.py launches, pure and the same on every rank."""
from __future__ import annotations

import dataclasses

from .. import abi
from ..runtime.kernel import Kernel
from .launch import Launch, one_shot_launch, pull_launch, two_shot_launch, two_shot_ll_launch
from .plan import Plan
from .rules import Algo


@dataclasses.dataclass(frozen=True)
class Route:
    algo: Algo
    kernel: Kernel | None = None       # None: NCCL's (fastcomm does not serve it)
    groups: tuple[int, ...] = ()       # abi.FLAT / ISLAND / PARTNER: the tables it takes, in parameter order
    launch: Launch | None = None


def allreduce_route(plan: Plan, nbytes: int, elem_size: int, forced: str | None = None) -> Route:
    """The route of an all-reduce of ``nbytes`` (elements of ``elem_size`` bytes); ``forced``: an algorithm
    name that overrides the plan's size rule (None or "auto": the rule)."""
    algo = plan.algo_for(nbytes, None if forced == "auto" else forced)
    numel = nbytes // elem_size
    if algo is Algo.NCCL:
        return Route(algo)
    if algo is Algo.ONE_SHOT:
        lc = one_shot_launch(nbytes, plan.max_blocks)
        # With islands, one launch sums inside the island, rounds to the dtype, then sums across partners, both
        # in a fixed order (one_shot.cuh, fc_one_shot_islands), so every rank gets the same bits.
        if plan.islands is not None:
            return Route(algo, abi.ONE_SHOT_ISLANDS, (abi.ISLAND, abi.PARTNER), lc)
        return Route(algo, abi.ONE_SHOT, (abi.FLAT,), lc)
    if algo is Algo.TWO_SHOT_LL:  # flat in every layout, as the two-shot
        return Route(algo, abi.TWO_SHOT_LL, (abi.FLAT,), two_shot_ll_launch(nbytes, plan.world_size, plan.max_blocks))
    if algo is Algo.PULL:  # one or two stages by world and message size (policy.pull_stages); P2P only
        lc = pull_launch(nbytes, plan.world_size, plan.max_blocks)
        return Route(algo, abi.PULL if lc.stages == 1 else abi.PULL2, (abi.FLAT,), lc)
    if algo is Algo.TWO_SHOT_ISLANDS:
        # Reduce-scatter in the island, cross once with 1/island size, all-gather in the island: the one-shot
        # island form's rounding and order, so the same bits; cut for a world of the island's size.
        return Route(algo, abi.TWO_SHOT_ISLANDS, (abi.ISLAND, abi.PARTNER),
                     two_shot_launch(numel, elem_size, plan.island_size, plan.max_blocks))
    return Route(algo, abi.TWO_SHOT, (abi.FLAT,), two_shot_launch(numel, elem_size, plan.world_size, plan.max_blocks))
