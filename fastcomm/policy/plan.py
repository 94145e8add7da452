"""One pure planning step: what the ranks found (Facts) and the settings (Config) -> a frozen Plan.

The workspace gathers the facts collectively (so every rank holds the same ones), calls ``make_plan``, and
allocates memory for the plan; ops ask the plan which algorithm serves a call. ``fastcomm topo`` builds
facts from the probe alone and shows the plan a workspace on those GPUs would make.
"""
from __future__ import annotations

import dataclasses

from ..abi import MAX_BLOCKS, MAX_WORLD, VEC_BYTES
from ..config import Config
from ..errors import FastcommError
from ..units import format_size
from .fused import FUSED_TWO_SHOT_MAX_TOKENS, FUSED_TWO_SHOT_MIN_WORLD, fused_cluster_form
from .launch import round_up, two_shot_ll_max_bytes
from .links import LinkType, validate_islands
from .rules import DEFAULT_TABLE, Algo, PolicyKey, Rule, SizeRange, Transport, choose_algo, render_ranges, \
    size_ranges

ONE_SHOT_ALIGN = 4096  # scaled one-shot bounds are rounded down to this


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
    p2p_note: str = ""             # what the build-time P2P check found (for describe())
    # Thread-block clusters (the fused op's cluster form): the lowest compute capability major over the ranks,
    # and whether every rank's device launches clusters. Agreed, so every rank picks the same fused form (the
    # forms add a row's sum of squares in different orders).
    cc_major: int = 0
    cluster_launch: bool = False


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
    fused_max_bytes: int = 0   # the one-shot fused all-reduce + RMSNorm serves inputs up to this (the one-shot's
                               # range); the two-shot form above it: policy.fused.choose_fused
    two_shot_ll_max_bytes: int = 0  # the Lamport two-shot serves inputs up to this (what the one-shot's slots hold)
    fused_cluster: bool = False  # the flat one-shot fused op runs as one cluster per row (policy.fused_cluster_form)

    def algo_for(self, nbytes: int, forced: str | None = None) -> Algo:
        """The algorithm for one message (NCCL: not served by fastcomm). The pull is P2P only: forced per
        call on the host transport it is NCCL, 'not served' (make_plan keeps it out of host rules)."""
        algo = choose_algo(nbytes, self.rules, one_shot_max_bytes=self.one_shot_max_bytes,
                           max_bytes=self.max_bytes, forced=forced or self.forced_algo,
                           two_shot_ll_max_bytes=self.two_shot_ll_max_bytes, island_size=self.island_size)
        return Algo.NCCL if algo is Algo.PULL and self.transport is not Transport.P2P else algo

    def ranges(self) -> tuple[SizeRange, ...]:
        return size_ranges(self.rules, one_shot_max_bytes=self.one_shot_max_bytes, max_bytes=self.max_bytes,
                           forced=self.forced_algo, two_shot_ll_max_bytes=self.two_shot_ll_max_bytes,
                           island_size=self.island_size)

    @property
    def island_size(self) -> int:
        """Ranks per island (0: flat). From 2, the island two-shot serves what the table gives the two-shots."""
        return len(self.islands[0]) if self.islands else 0

    def describe(self) -> str:
        isl = f", islands {self.islands}" if self.islands else ""
        fused = f"fused all-reduce + RMSNorm <= {format_size(self.fused_max_bytes)}" if self.fused_max_bytes \
            else "no fused all-reduce + RMSNorm"
        if self.fused_max_bytes and self.fused_cluster:
            fused += " (one thread-block cluster per row)"
        if self.world_size >= FUSED_TWO_SHOT_MIN_WORLD and not self.islands:  # policy.fused.choose_fused
            fused += f", two-shot form above that to {FUSED_TWO_SHOT_MAX_TOKENS} tokens"
        return (f"fastcomm: {self.world_size} ranks, transport {self.transport.value}, link {self.link.value}{isl}; "
                f"{'; '.join(render_ranges(self.ranges()))}; {fused} (policy: {self.rules_source})")


def one_shot_copies(world: int, islands: tuple[tuple[int, ...], ...] | None) -> int:
    """Copies of the message each GPU sends (P2P) or reads from host memory (host) in a one-shot: every
    peer's, or, with islands, the island's peers' and then one partner per other island."""
    if not islands:
        return world - 1
    return (len(islands[0]) - 1) + (len(islands) - 1)


def default_rules(transport: Transport, link: LinkType, world: int, copies: int) -> tuple[tuple[Rule, ...], str]:
    """The default table's rules for this world size, and how they were found.

    Rows keyed by an exact world size are used as written. Rows for any world size carry bounds measured
    (or modelled) at 2 ranks, and the one-shot bound is scaled by a bytes-per-GPU model: a one-shot of S bytes
    makes each GPU move ``copies`` copies of S (n - 1 flat), against about 2 S (n - 1) / n for the two-shot,
    whose cost grows little with n. The one-shot is kept while each GPU moves no more bytes than at the
    2-rank bound (one copy): S_n = S_2 / copies, rounded down to 4 KiB. (8 ranks over host memory: 512 KiB
    at 2 ranks -> 72 KiB, where each of 8 GPUs reads 7 x 72 KiB from host memory.)
    """
    for lk in (link, LinkType.UNKNOWN):
        rules = DEFAULT_TABLE.get(PolicyKey(transport, lk, world))
        if rules is not None:
            return rules, f"defaults for {world} ranks"
        rules = DEFAULT_TABLE.get(PolicyKey(transport, lk, 0))
        if rules is not None:
            return scale_one_shot(rules, copies), f"defaults scaled to {copies} copies per GPU"
    return (), "no default rules"


def scale_one_shot(rules: tuple[Rule, ...], copies: int) -> tuple[Rule, ...]:
    """``rules`` with the one-shot bound divided by ``copies`` (see default_rules)."""
    if copies <= 1:
        return rules
    out = []
    for r in rules:
        if r.algo is Algo.ONE_SHOT:
            r = Rule(max(ONE_SHOT_ALIGN, r.max_bytes // copies // ONE_SHOT_ALIGN * ONE_SHOT_ALIGN), r.algo)
        if not out or r.max_bytes > out[-1].max_bytes:
            out.append(r)
    return tuple(out)


def choose_transport(all_p2p: bool, requested: str) -> Transport:
    """P2P where every pair reaches the other and the settings do not ask for host memory; else host."""
    return Transport.P2P if all_p2p and requested != "host" else Transport.HOST


def make_plan(facts: Facts, config: Config) -> Plan:
    """The plan for these facts; raises FastcommError when the settings ask for what the facts forbid."""
    world = facts.world_size
    if not 2 <= world <= MAX_WORLD:
        raise FastcommError(f"fastcomm needs 2..{MAX_WORLD} ranks, group has {world}")
    if config.transport == "p2p" and not facts.all_p2p:
        raise FastcommError("FASTCOMM_TRANSPORT=p2p but some GPU pairs cannot reach each other by P2P")
    transport = choose_transport(facts.all_p2p, config.transport)
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
    if config.algo == Algo.PULL.value and transport is not Transport.P2P:
        raise FastcommError("FASTCOMM_ALGO=pull needs the P2P transport (it reads peers' GPU memory); this "
                            "workspace uses host memory: unset it or pick one_shot / two_shot")
    if config.algo == Algo.TWO_SHOT_ISLANDS.value and not (islands and len(islands[0]) >= 2):
        raise FastcommError("FASTCOMM_ALGO=two_shot_islands needs islands of at least 2 ranks (FASTCOMM_ISLANDS, "
                            "or a probe that finds them); this workspace is flat: unset it or pick two_shot")
    use_cluster, why_not = fused_cluster_form(setting=config.fused_cluster, cc_major=facts.cc_major,
                                              cluster_launch=facts.cluster_launch, islands=bool(islands))
    if why_not is not None:
        raise FastcommError(f"FASTCOMM_FUSED_CLUSTER=on: {why_not}")
    if facts.tuned_rules is not None:
        rules, source = facts.tuned_rules, facts.rules_source
    else:
        rules, how = default_rules(transport, facts.link, world, one_shot_copies(world, islands or None))
        source = how if facts.rules_source == "defaults" else f"{facts.rules_source}; {how}"
    if transport is not Transport.P2P:  # no peer-readable memory: whatever a table says, the two-shot serves
        rules = tuple(Rule(r.max_bytes, Algo.TWO_SHOT) if r.algo is Algo.PULL else r for r in rules)
    one_shot_max = min(config.one_shot_max_bytes, config.max_bytes)
    # The fused op is the one-shot exchange laid out by rows: the same bytes, so the same range.
    one_shot_rule = next((r.max_bytes for r in rules if r.algo is Algo.ONE_SHOT), 0)
    # The Lamport two-shot lives in the one-shot's slots (flat group; fastcomm.layout sizes them the same way).
    ll_max = min(config.max_bytes, two_shot_ll_max_bytes(round_up(one_shot_max, VEC_BYTES), world,
                                                         transport is Transport.HOST))
    return Plan(world_size=world, transport=transport, link=facts.link, islands=islands or None, rules=rules,
                rules_source=source, max_bytes=config.max_bytes, one_shot_max_bytes=one_shot_max,
                max_blocks=min(MAX_BLOCKS, config.max_blocks or facts.num_sms or MAX_BLOCKS),
                forced_algo=config.algo, fused_max_bytes=min(one_shot_max, one_shot_rule),
                two_shot_ll_max_bytes=ll_max, fused_cluster=use_cluster)
