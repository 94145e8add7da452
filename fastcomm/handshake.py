"""The collective steps of building a workspace, over the caller's (CPU) process group.

Every helper here runs the same collectives on every rank whatever happens locally, so a rank that fails
alone never leaves the others waiting: failures are shared and raised on every rank at once. ``gather_facts``
collects what the ranks found into one ``policy.Facts``, the same on every rank.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist

from .config import Config
from .errors import FastcommError
from .policy import Facts, LinkType, islands, worst_link

log = logging.getLogger("fastcomm")


class Handshake:
    def __init__(self, group: Any):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def gather(self, obj) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def decided_by_rank0(self, decide: Callable[[], Any], default):
        """Run ``decide()`` on rank 0 only and give every rank its answer, so all ranks act alike.

        Returns (value, error): value is ``default`` where rank 0 raised, and error its message; each caller
        chooses whether that error is advisory or fatal (it is then fatal on every rank at once).
        """
        verdict = [(default, None)]
        if self.rank == 0:
            try:
                verdict = [(decide(), None)]
            except Exception as e:
                verdict = [(default, f"{type(e).__name__}: {e}")]
        dist.broadcast_object_list(verdict, src=dist.get_global_rank(self.group, 0), group=self.group)
        return verdict[0]

    def all_ok(self, step: str, fn: Callable[[], Any]) -> list:
        """Run a local step on every rank and share the outcome: every rank's result, or, if any rank
        failed, the same error on all of them (naming who failed)."""
        err, value = None, None
        try:
            value = fn()
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        outcomes = self.gather((err, value))
        bad = [(r, e) for r, (e, _) in enumerate(outcomes) if e]
        if bad:
            raise FastcommError(f"fastcomm workspace: {step} failed on " + "; ".join(f"rank {r}: {e}" for r, e in bad))
        return [v for _, v in outcomes]


def norm_uuid(u: str) -> str:
    """torch prints GPU UUIDs bare, NVML and nvidia-smi with a 'GPU-' prefix."""
    u = u.strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def gather_facts(hs: Handshake, device_index: int, config: Config) -> Facts:
    """What every rank found, agreed: same node, same settings, one GPU each, P2P between every pair,
    the probed link and islands (rank 0 probes), the tune cache's rules (rank 0 reads)."""
    props = torch.cuda.get_device_properties(device_index)
    visible = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    me = dict(host=socket.gethostname(), pid=os.getpid(), uuid=str(props.uuid), settings=config.agreed(),
              visible=visible, sms=props.multi_processor_count)
    infos = hs.gather(me)
    if len({i["host"] for i in infos}) != 1:
        raise FastcommError("fastcomm workspaces span one node only; ranks are on "
                            f"{sorted({i['host'] for i in infos})}")
    if len({repr(i["settings"]) for i in infos}) != 1:
        raise FastcommError("fastcomm settings differ across ranks (FASTCOMM_* environment or arguments): "
                            + "; ".join(f"rank {r}: {i['settings']}" for r, i in enumerate(infos)))
    if len({i["uuid"] for i in infos}) != hs.world_size:
        raise FastcommError("two ranks use the same GPU; fastcomm needs one GPU per rank")

    # P2P as seen from this process; the transport decision uses every rank's row, so all agree.
    row = []
    for r, info in enumerate(infos):
        if r == hs.rank:
            row.append(True)
        elif info["uuid"] in visible:
            row.append(bool(torch.cuda.can_device_access_peer(device_index, visible.index(info["uuid"]))))
        else:
            row.append(False)  # not visible here: CUDA IPC across isolated devices is not attempted
    p2p_rows = hs.gather(row)
    all_p2p = all(all(r) for r in p2p_rows)
    link, probed = _probe_links(hs, [i["uuid"] for i in infos])
    transport = "p2p" if all_p2p and config.transport != "host" else "host"
    tuned, source = _read_tune_cache(hs, config, transport, link, device_index)
    return Facts(world_size=hs.world_size, all_p2p=all_p2p, link=link, probed_islands=probed,
                 num_sms=min(i["sms"] for i in infos), tuned_rules=tuned, rules_source=source)


def _probe_links(hs: Handshake, uuids: list[str]) -> tuple[LinkType, tuple[tuple[int, ...], ...] | None]:
    """The worst link among this group's GPUs and, where the probe finds them, islands (only when the
    group spans CPU sockets: cross-socket P2P writes are the slow ones hierarchical mode avoids).
    Rank 0 probes; every rank uses its verdict, so all pick the same policy row."""

    def probe():
        from . import topology

        topo = topology.probe()
        pos = {norm_uuid(g.uuid): i for i, g in enumerate(topo.gpus) if g.uuid}
        if not all(norm_uuid(u) in pos for u in uuids):
            log.info("fastcomm: topology probe did not see every rank's GPU (%s); conservative policy",
                     "; ".join(topo.notes) or "UUIDs not matched")
            return LinkType.UNKNOWN.value, None
        ranks = [pos[norm_uuid(u)] for u in uuids]
        link = worst_link(topo.link, ranks)
        groups = islands(topo.link, ranks) if link is LinkType.CROSS_SOCKET else ()
        isl = tuple(tuple(ranks.index(p) for p in g) for g in groups) if len(groups) > 1 else None
        return link.value, isl

    (link, isl), err = hs.decided_by_rank0(probe, (LinkType.UNKNOWN.value, None))
    if err and hs.rank == 0:  # topology is advisory; the UNKNOWN row is conservative
        log.warning("fastcomm: topology probe failed (%s); using conservative defaults", err)
    return LinkType(link), isl


def _read_tune_cache(hs: Handshake, config: Config, transport: str, link: LinkType, device_index: int):
    """Rank 0 reads the tune cache (if any); every rank runs the rules it chose."""
    from . import tunecache

    def read():
        fp = tunecache.fingerprint_here(transport, link, hs.world_size, device_index)
        return tunecache.rules_from_file(config, fp)

    (rules, why), err = hs.decided_by_rank0(read, (None, ""))
    if err is not None:  # an explicit but unusable FASTCOMM_TUNE_FILE: fail on every rank alike
        raise tunecache.TuneCacheError(err)
    return rules, (why or "defaults")
