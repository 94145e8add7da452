"""The collective steps of building a workspace, over the caller's (CPU) process group.

Every helper here runs the same collectives on every rank whatever happens locally, so a rank that fails
alone never leaves the others waiting: failures are shared and raised on every rank at once. ``gather_facts``
collects what the ranks found into one ``policy.Facts``, the same on every rank.
"""
from __future__ import annotations

import ctypes
import logging
import os
import secrets
import socket
import struct
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import abi
from .runtime import jit, launch_ex
from .config import Config
from .errors import FastcommError
from .policy import Facts, LinkType, islands, worst_link
from .policy.plan import choose_transport

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
              visible=visible, sms=props.multi_processor_count, clusters=_cluster_support(device_index))
    infos = hs.gather(me)
    if len({i["host"] for i in infos}) != 1:
        raise FastcommError("fastcomm workspaces span one node only; ranks are on "
                            f"{sorted({i['host'] for i in infos})}")
    if len({repr(i["settings"]) for i in infos}) != 1:
        raise FastcommError("fastcomm settings differ across ranks (FASTCOMM_* environment or arguments): "
                            + "; ".join(f"rank {r}: {i['settings']}" for r, i in enumerate(infos)))
    if len({i["uuid"] for i in infos}) != hs.world_size and not config.test_shared_gpu:
        raise FastcommError("two ranks use the same GPU; fastcomm needs one GPU per rank")

    # P2P as seen from this process; the transport decision uses every rank's row, so all agree.
    row = []
    for r, info in enumerate(infos):
        if r == hs.rank or info["uuid"] == me["uuid"]:
            row.append(True)  # the same device (test mode: ranks sharing a GPU reach it through CUDA IPC)
        elif info["uuid"] in visible:
            row.append(bool(torch.cuda.can_device_access_peer(device_index, visible.index(info["uuid"]))))
        else:
            row.append(False)  # not visible here: CUDA IPC across isolated devices is not attempted
    p2p_rows = hs.gather(row)
    all_p2p = all(all(r) for r in p2p_rows)
    check_note = "P2P not reported between every pair" if not all_p2p else "P2P check off (FASTCOMM_P2P_CHECK=0)"
    if all_p2p and config.transport != "host" and config.p2p_check:
        broken, ms = check_p2p(hs, device_index, config)
        check_note = f"P2P writes checked between every pair ({ms:.1f} ms)"
        if broken:
            pairs = ", ".join(f"rank {a} -> rank {b}" for a, b in broken)
            if config.transport == "p2p":
                raise FastcommError(f"FASTCOMM_TRANSPORT=p2p but P2P writes did not arrive for {pairs} (the driver "
                                    "reports P2P; ACS or an IOMMU may be in the way)")
            if hs.rank == 0:
                log.warning("fastcomm: P2P is reported but writes did not arrive for %s (ACS or an IOMMU in the "
                            "way?); using the host transport", pairs)
            all_p2p = False
            check_note = f"P2P writes lost for {pairs}: host transport"
    link, probed = _probe_links(hs, [i["uuid"] for i in infos])
    # The tune cache is keyed by the transport the plan will pick: the same decision, asked early.
    tuned, source = _read_tune_cache(hs, config, choose_transport(all_p2p, config.transport).value, link,
                                     device_index)
    return Facts(world_size=hs.world_size, all_p2p=all_p2p, link=link, probed_islands=probed,
                 num_sms=min(i["sms"] for i in infos), tuned_rules=tuned, rules_source=source, p2p_note=check_note,
                 cc_major=min(i["clusters"][0] for i in infos), cluster_launch=all(i["clusters"][1] for i in infos))


def _cluster_support(device_index: int) -> tuple[int, bool]:
    """(compute capability major, launches thread-block clusters) of this rank's device; (0, False) where the
    driver cannot say (then no rank uses the cluster form)."""
    try:
        return launch_ex.device_supports_clusters(device_index)
    except Exception:  # a driver without the attribute or entry point: the block-per-split form serves
        return 0, False


CHECK_STORES = 64  # 16-byte stores per (source, destination): 1 KiB, enough to see a path that drops writes
_GOLDEN = 0x9E3779B97F4A7C15


def _check_pattern(nonce: int, src: int, dst: int) -> int:
    return (nonce ^ (src << 40) ^ (dst << 32)) & ((1 << 64) - 1)


def expected_check_bytes(pattern: int, count: int = CHECK_STORES) -> bytes:
    """What ``fc_p2p_check`` writes (csrc/comm/p2p_check.cuh): per store i, v = pattern ^ (i * golden), as the
    32-bit words (lo, hi, ~lo, ~hi)."""
    out = bytearray()
    m32 = (1 << 32) - 1
    for i in range(count):
        v = pattern ^ ((i * _GOLDEN) & ((1 << 64) - 1))
        lo, hi = v & m32, v >> 32
        out += struct.pack("<IIII", lo, hi, ~lo & m32, ~hi & m32)
    return bytes(out)


def check_p2p(hs: Handshake, device_index: int, config: Config) -> tuple[list[tuple[int, int]], float]:
    """Every rank writes a pattern into every peer's memory through CUDA IPC with the collectives' store
    path, then reads its own memory back: (pairs (src, dst) whose writes did not arrive, milliseconds).

    Nothing here waits on a peer's data on the device (a lost write leaves the pattern absent; the host copy
    just sees it), so a broken pair costs a fallback, not a timeout and a dead CUDA context.
    """
    import cupy
    from cupy_backends.cuda.api import driver
    from cupy_backends.cuda.api import runtime as rt

    t0 = time.perf_counter()
    n, me = hs.world_size, hs.rank
    slot = CHECK_STORES * 16
    nonce, _ = hs.decided_by_rank0(lambda: secrets.randbits(24), 0)
    peers: dict[int, int] = {}
    buf = 0
    with cupy.cuda.Device(device_index):
        try:
            def alloc() -> bytes:
                nonlocal buf
                buf = rt.malloc(n * slot)
                rt.memset(buf, 0, n * slot)
                return bytes(rt.ipcGetMemHandle(buf))

            handles = hs.all_ok("allocating the P2P check buffer", alloc)

            def open_peers() -> None:
                for r, h in enumerate(handles):
                    if r != me:
                        peers[r] = rt.ipcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess)

            hs.all_ok("opening peer check buffers (CUDA IPC)", open_peers)

            def write() -> None:
                fn = jit.function(device_index, config.cache_dir, abi.P2P_CHECK.symbol())
                for r, base in peers.items():
                    if config.test_break_p2p == (me, r):
                        continue  # test switch: this pair's writes are "lost"
                    args = abi.P2P_CHECK.pack(base + me * slot, _check_pattern(nonce, me, r), CHECK_STORES)
                    driver.launchKernel(fn, 1, 1, 1, 64, 1, 1, 0, 0, args.address, 0)
                rt.deviceSynchronize()

            hs.all_ok("writing the P2P check pattern", write)  # also the barrier: every rank's writes are done

            def read_back() -> list[int]:
                host = (ctypes.c_char * (n * slot))()
                rt.memcpy(ctypes.addressof(host), buf, n * slot, 2)  # cudaMemcpyDeviceToHost
                got = bytes(host)
                return [src for src in range(n) if src != me and
                        got[src * slot:(src + 1) * slot] != expected_check_bytes(_check_pattern(nonce, src, me))]

            # Every step is an agreement, so a rank that fails locally fails all of them at the same step and
            # the collectives below stay in step.
            verdicts = hs.all_ok("reading back the P2P check pattern", read_back)
        finally:
            for p in peers.values():
                try:
                    rt.ipcCloseMemHandle(p)
                except Exception:  # cleanup goes on; the verdict (or the original error) is what matters
                    pass
            try:
                hs.gather(None)  # nobody frees its buffer while a peer may still have it mapped
            finally:
                if buf:
                    rt.free(buf)
    broken = [(src, dst) for dst, lost in enumerate(verdicts) for src in lost]
    return broken, (time.perf_counter() - t0) * 1e3


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
