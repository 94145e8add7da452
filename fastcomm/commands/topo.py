"""`fastcomm topo`: what the topology probe sees, and what fastcomm will do on it.

Prints the link and P2P matrices, each GPU's NUMA node and PCIe link, the islands for the hierarchical mode,
what could not be read, and the plan: the transport and the algorithm for each message-size range, from the
same policy table, tune cache and configuration that a workspace would use. On 0 or 1 GPUs there is no plan:
fastcomm has nothing to do there.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .. import policy, topology
from ..config import Config
from ..errors import FastcommError
from ..policy import LinkType
from ..topology import Topology
from ..units import format_size

# Our four classes, shown with the nvidia-smi code of their fastest member.
_CODES = {LinkType.NVLINK: "NV", LinkType.PCIE_SWITCH: "PIX", LinkType.HOST_BRIDGE: "PHB",
          LinkType.CROSS_SOCKET: "SYS", LinkType.UNKNOWN: "?"}
_LEGEND = ("  NV = NVLink; PIX = PCIe switches only (PIX/PXB); PHB = through a host bridge, same socket (PHB/NODE);",
           "  SYS = across sockets or NUMA nodes; ? = not read. pcie now is low on idle GPUs (power saving).")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("topo", help="GPU topology, P2P access, islands and the algorithm per size",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--from-file", metavar="PATH",
                   help="read a recorded `nvidia-smi topo -m` (or a `fastcomm topo --json` dump) instead of probing")
    p.add_argument("--p2p-file", metavar="PATH", help="recorded `nvidia-smi topo -p2p w` to go with --from-file")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        config = Config.from_env()
        topo = load(args.from_file, getattr(args, "p2p_file", None))
    except (OSError, ValueError) as e:  # unreadable file, unparsable table, bad FASTCOMM_* value (ConfigError)
        print(f"fastcomm topo: {e}", file=sys.stderr)
        return 2
    plan, why_none = make_plan(topo, config, tuned=True)
    if args.json:
        print(json.dumps(to_json(topo, plan, why_none, config), indent=2))
    else:
        print("\n".join(render(topo, plan, why_none, config)))
    return 0


def load(path: str | None, p2p_path: str | None = None) -> Topology:
    """The probed topology, or one recorded in ``path`` (nvidia-smi text or our JSON)."""
    if path is None:
        return topology.probe()
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        return Topology.from_json(data.get("topology", data))  # our --json output, or a bare to_json()
    p2p_text = Path(p2p_path).read_text() if p2p_path else None
    return topology.topology_from_nvidia_smi(text, p2p_text, source="recorded")


def facts_from(topo: Topology) -> policy.Facts:
    """What a workspace on all of ``topo``'s GPUs would find (the probe's P2P answer, unchecked)."""
    worst, all_p2p = policy.summarize(topo.link, topo.p2p)
    isl = policy.islands(topo.link) if worst is LinkType.CROSS_SOCKET else ()
    return policy.Facts(world_size=len(topo.gpus), all_p2p=bool(all_p2p), link=worst,
                        probed_islands=isl if len(isl) > 1 else None)


def make_plan(topo: Topology, config: Config, tuned: bool = False) -> tuple[policy.Plan | None, str | None]:
    """(plan, None) for what a workspace on all of ``topo``'s GPUs would run, or (None, why there is none).
    With ``tuned``, the rules come from the tune cache where one applies (as at workspace build)."""
    n = len(topo.gpus)
    if n < 2:
        return None, f"nothing to do on {n} GPU{'' if n == 1 else 's'} (fastcomm needs at least 2)"
    facts = facts_from(topo)
    try:
        plan = policy.make_plan(facts, config)
        if tuned:
            rules, source = tuned_rules(topo, plan, config)
            plan = policy.make_plan(dataclasses.replace(facts, tuned_rules=rules, rules_source=source), config)
        return plan, None
    except FastcommError as e:  # settings the facts forbid, or an explicit FASTCOMM_TUNE_FILE that is unusable
        return None, str(e)


def tuned_rules(topo: Topology, plan: policy.Plan, config: Config) -> tuple[tuple[policy.Rule, ...] | None, str]:
    """The tune cache's rules for this plan, as a workspace on these GPUs would read them, or (None, why not).
    The fingerprint is built from the probe (GPU name and count) and the plan (transport, link)."""
    from .. import tunecache

    names = {g.name for g in topo.gpus}
    if len(names) != 1 or None in names:
        return None, "defaults (GPU names not read, so no tune cache can be matched)"
    fp = tunecache.fingerprint_for(names.pop(), plan.world_size, plan.transport, plan.link)
    if fp is None:
        return None, "defaults (torch is not installed, so no tune cache can be matched)"
    return tunecache.rules_from_file(config, fp)


def to_json(topo: Topology, plan: policy.Plan | None, why_none: str | None, config: Config) -> dict:
    worst, all_p2p = policy.summarize(topo.link, topo.p2p)
    return {
        "topology": topo.to_json(),
        "worst_link": worst.value,
        "all_p2p": all_p2p,
        "islands": [list(i) for i in policy.islands(topo.link)],
        "forced_islands": [list(i) for i in config.islands] if config.islands else None,
        "plan": None if plan is None else {
            "transport": plan.transport.value, "link": plan.link.value, "world_size": plan.world_size,
            "islands": [list(i) for i in plan.islands] if plan.islands else None,
            "algo_forced": config.algo, "max_bytes": plan.max_bytes, "one_shot_max_bytes": plan.one_shot_max_bytes,
            "rules_source": plan.rules_source,
            "ranges": [{"min_bytes": r.min_bytes, "max_bytes": r.max_bytes, "algo": r.algo.value}
                       for r in plan.ranges()]},
        "no_plan": why_none,
    }


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def _matrix(title: str, n: int, cell, extra: list[tuple[str, list[str]]] = ()) -> list[str]:
    """An nvidia-smi style matrix over ranks, with per-GPU columns (``extra``) on the right."""
    return _table([[title] + [str(j) for j in range(n)] + [name for name, _ in extra]] +
                  [[str(i)] + ["X" if i == j else cell(i, j) for j in range(n)] + [col[i] for _, col in extra]
                   for i in range(n)])


def _pcie(gen, width) -> str:
    return "?" if gen is None and width is None else f"gen{gen or '?'} x{width or '?'}"


def _gpu_lines(topo: Topology) -> list[str]:
    gpus = topo.gpus
    if not any(g.name for g in gpus):  # a recorded `topo -m` alone: the matrix says all there is
        return []
    return ["", *_table([["rank", "gpu", "name", "bus id", "uuid", "cc"]] + [
        [str(r), str(g.index), g.name or "?", g.pci_bus_id or "?", g.uuid or "?",
         ".".join(map(str, g.compute_capability)) if g.compute_capability else "?"]
        for r, g in enumerate(gpus)])]


def render(topo: Topology, plan: policy.Plan | None, why_none: str | None, config: Config) -> list[str]:
    n = len(topo.gpus)
    out = [f"fastcomm topology: {n} GPU{'' if n == 1 else 's'} (source: {topo.source})", *_gpu_lines(topo)]
    if n:
        per_gpu = [("numa", ["?" if g.numa_node is None else str(g.numa_node) for g in topo.gpus]),
                   ("pcie now", [_pcie(g.pcie_gen, g.pcie_width) for g in topo.gpus]),
                   ("pcie max", [_pcie(g.pcie_gen_max, g.pcie_width_max) for g in topo.gpus])]
        out += ["", *_matrix("link", n, lambda i, j: _CODES[topo.link[i][j]], per_gpu), *_LEGEND]
    if n > 1:
        out += ["", *_matrix("p2p w", n, lambda i, j: {True: "OK", False: "no", None: "?"}[topo.p2p[i][j]])]
        out += ["", _islands_line(topo, plan)]
        if config.islands:
            out.append(f"  FASTCOMM_ISLANDS overrides this with {list(map(list, config.islands))}")
    if topo.notes:
        out += ["", "could not read / notes:", *(f"  - {note}" for note in topo.notes)]
    out += ["", *_render_plan(plan, why_none, config)]
    return out


def _islands_line(topo: Topology, plan: policy.Plan | None) -> str:
    isl = policy.islands(topo.link)
    shown = " ".join("[" + " ".join(map(str, i)) + "]" for i in isl)
    if len(isl) > 1 and plan is not None and plan.transport is policy.Transport.HOST:
        # The workspace refuses islands on the host transport (it is flat): do not propose them.
        return f"islands: {shown} by links, not used: the host transport is flat"
    how = ("hierarchical: reduce inside each island, exchange once across, broadcast back" if len(isl) > 1
           else "flat: one island")
    return f"islands: {shown}  ({how})"


def _render_plan(plan: policy.Plan | None, why_none: str | None, config: Config) -> list[str]:
    if plan is None:
        return [f"plan: {why_none}"]
    isl = f", islands {[list(i) for i in plan.islands]}" if plan.islands else ""
    head = (f"plan: transport {plan.transport.value}, link {plan.link.value}, world size {plan.world_size}{isl} "
            f"(algo {config.algo}, max {format_size(plan.max_bytes)}, "
            f"one-shot max {format_size(plan.one_shot_max_bytes)}; policy: {plan.rules_source})")
    return [head, *("  " + line for line in policy.render_ranges(plan.ranges()))]
