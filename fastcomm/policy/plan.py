"""One pure planning step: what the ranks found (Facts) and the settings (Config) -> a frozen Plan.

The workspace gathers the facts collectively (so every rank holds the same ones), calls ``make_plan``, and
allocates memory for the plan; ops ask the plan which algorithm serves a call. ``fastcomm topo`` builds
facts from the probe alone and shows the plan a workspace on those GPUs would make.
"""
from __future__ import annotations

import dataclasses

from ..abi import MAX_BLOCKS, MAX_WORLD
from ..config import Config
from ..errors import FastcommError
from .links import LinkType, validate_islands
from .rules import DEFAULT_TABLE, Algo, Rule, SizeRange, Transport, choose_algo, lookup_rules, render_ranges, \
    size_ranges


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the ranks found, identical on every rank (gathered collectively, or read off the probe)."""

    world_size: int
    all_p2p: bool                  # every pair reaches the other through P2P
    link: LinkType                 # the slowest link between the ranks' GPUs; UNKNOWN when not probed
    probed_islands: tuple[tuple[int, ...], ...] | None = None  # what the probe proposes (cross-socket boxes)
    num_sms: int = 0               # 0: unknown (the plan then allows MAX_BLOCKS)
    tuned_rules: tuple[Rule, ...] | None = None  # from a matching tune cache, else None
    rules_source: str = "defaults"


@dataclasses.dataclass(frozen=True)
class Plan:
    world_size: int
    transport: Transport
    link: LinkType
    islands: tuple[tuple[int, ...], ...] | None
    rules: tuple[Rule, ...]
    rules_source: str
    max_bytes: int
    one_shot_max_bytes: int
    max_blocks: int
    forced_algo: str = "auto"

    def algo_for(self, nbytes: int, forced: str | None = None) -> Algo:
        """The algorithm for one message (NCCL: not served by fastcomm)."""
        return choose_algo(nbytes, self.rules, one_shot_max_bytes=self.one_shot_max_bytes,
                           max_bytes=self.max_bytes, forced=forced or self.forced_algo)

    def ranges(self) -> tuple[SizeRange, ...]:
        return size_ranges(self.rules, one_shot_max_bytes=self.one_shot_max_bytes, max_bytes=self.max_bytes,
                           forced=self.forced_algo)

    def describe(self) -> str:
        isl = f", islands {self.islands}" if self.islands else ""
        return (f"fastcomm: {self.world_size} ranks, transport {self.transport.value}, link {self.link.value}{isl}; "
                f"{'; '.join(render_ranges(self.ranges()))} (policy: {self.rules_source})")


def make_plan(facts: Facts, config: Config) -> Plan:
    """The plan for these facts; raises FastcommError when the settings ask for what the facts forbid."""
    world = facts.world_size
    if not 2 <= world <= MAX_WORLD:
        raise FastcommError(f"fastcomm needs 2..{MAX_WORLD} ranks, group has {world}")
    if config.transport == "p2p" and not facts.all_p2p:
        raise FastcommError("FASTCOMM_TRANSPORT=p2p but some GPU pairs cannot reach each other by P2P")
    transport = Transport.P2P if facts.all_p2p and config.transport != "host" else Transport.HOST
    islands = config.islands or (facts.probed_islands if transport is Transport.P2P else None)
    if islands:
        try:
            islands = validate_islands(islands, world)
        except ValueError as e:
            raise FastcommError(f"FASTCOMM_ISLANDS: {e}") from None
        if transport is Transport.HOST:
            raise FastcommError("island (hierarchical) mode needs P2P; the host transport is flat by nature")
        if len(islands) < 2:
            islands = None
    rules = facts.tuned_rules if facts.tuned_rules is not None else \
        lookup_rules(DEFAULT_TABLE, transport, facts.link, world)
    return Plan(world_size=world, transport=transport, link=facts.link, islands=islands or None, rules=rules,
                rules_source=facts.rules_source, max_bytes=config.max_bytes,
                one_shot_max_bytes=min(config.one_shot_max_bytes, config.max_bytes),
                max_blocks=min(MAX_BLOCKS, config.max_blocks or facts.num_sms or MAX_BLOCKS),
                forced_algo=config.algo)
