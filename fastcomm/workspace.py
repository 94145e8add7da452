"""The workspace: buffers shared by every rank of a group, built collectively, released by ``close()``.

Collective contract: every rank of the group constructs the workspace together, then calls the same ops
with the same shapes, dtypes and algorithms in the same order (as with NCCL), and finally closes it.
Ranks that break the contract time out with an error naming the stalled peer; they never hang forever.

Ops are free functions in ``fastcomm.ops`` that take a workspace; this module only owns memory.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import os
import secrets
import socket
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import layout as L
from . import policy
from .config import Config
from .errors import ErrorRecord, FastcommError, FastcommTimeoutError, describe
from .policy import Algo, Transport
from .topology import LinkType

log = logging.getLogger("fastcomm")

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "fastcomm-"
_ids = itertools.count(1)
_registry: "weakref.WeakValueDictionary[int, Workspace]" = weakref.WeakValueDictionary()


def get(ws_id: int) -> "Workspace":
    """The live workspace with this id (torch custom ops carry workspaces as ints)."""
    try:
        return _registry[ws_id]
    except KeyError:
        raise FastcommError(f"no open fastcomm workspace with id {ws_id}") from None


def _rt():
    from cupy_backends.cuda.api import runtime

    return runtime


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PROT_RW, MAP_SHARED = 0x1 | 0x2, 0x01
_HOST_REGISTER_PORTABLE, _HOST_REGISTER_MAPPED = 0x01, 0x02  # cudaHostRegister flags
_H2D = 1  # cudaMemcpyHostToDevice
_DTYPE_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Delete host segments whose creating process is gone (a crash between create and unlink)."""
    removed = []
    for f in shm_dir.glob(SHM_PREFIX + "*"):
        try:
            pid = int(f.name[len(SHM_PREFIX):].split("-")[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            f.unlink(missing_ok=True)
            removed.append(f.name)
    return removed


class _Resources:
    """Everything that must be released, kept apart from the Workspace so a finalizer can own it."""

    def __init__(self, device_index: int):
        self.device_index = device_index
        self.own_buffer = 0
        self.local_buffer = 0
        self.peer_ptrs: list[int] = []
        self.err_ptr = 0
        self.host_addr = 0
        self.host_size = 0
        self.host_registered = False
        self.shm_path: Path | None = None

    def release(self) -> None:
        try:
            import cupy

            rt = _rt()
            with cupy.cuda.Device(self.device_index):
                try:
                    rt.deviceSynchronize()  # no kernel may still touch what we free
                except Exception:  # a trapped context: free what can be freed
                    pass
                for p in self.peer_ptrs:
                    _quiet(rt.ipcCloseMemHandle, p)
                self.peer_ptrs = []
                for attr in ("own_buffer", "local_buffer"):
                    if getattr(self, attr):
                        _quiet(rt.free, getattr(self, attr))
                        setattr(self, attr, 0)
                if self.host_registered:
                    _quiet(rt.hostUnregister, self.host_addr)
                    self.host_registered = False
                if self.err_ptr:
                    _quiet(rt.freeHost, self.err_ptr)
                    self.err_ptr = 0
        finally:
            if self.host_addr:
                _libc.munmap(self.host_addr, self.host_size)
                self.host_addr = 0
            if self.shm_path is not None:
                self.shm_path.unlink(missing_ok=True)
                self.shm_path = None


def _quiet(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # release must go on; the first failure is logged, not raised
        log.debug("fastcomm release: %s%s failed: %s", fn.__name__, args, e)


class Workspace:
    """Shared buffers for all-reduce over ``group`` (any torch.distributed group; gloo is enough)."""

    def __init__(self, group: Any = None, device: torch.device | int | None = None, *,
                 config: Config | None = None, **overrides):
        self.config = config if config is not None else Config.from_env(**overrides)
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if not 2 <= self.world_size <= policy.MAX_WORLD:
            raise FastcommError(f"fastcomm needs 2..{policy.MAX_WORLD} ranks, group has {self.world_size}")
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.type != "cuda":
            raise FastcommError(f"workspace device must be CUDA, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.device_index = self.device.index
        self.id = next(_ids)
        self._functions: dict = {}  # (kernel family, dtype) -> CUfunction, filled at first use
        self._res = _Resources(self.device_index)
        self._finalizer = weakref.finalize(self, self._res.release)
        self.closed = False
        try:
            self._build()
        except BaseException:
            self._finalizer()
            self.closed = True
            raise
        _registry[self.id] = self

    # ---- construction -----------------------------------------------------------------------------

    def _gather(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _decided_by_rank0(self, decide, default):
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

    def _all_ok(self, step: str, fn) -> list:
        """Run a local step on every rank and share the outcome: every rank's result, or, if any rank
        failed, the same error on all of them (naming who failed). A rank that fails alone must not leave
        the others waiting in the next collective."""
        err, value = None, None
        try:
            value = fn()
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        outcomes = self._gather((err, value))
        bad = [(r, e) for r, (e, _) in enumerate(outcomes) if e]
        if bad:
            raise FastcommError(f"fastcomm workspace: {step} failed on " + "; ".join(f"rank {r}: {e}" for r, e in bad))
        return [v for _, v in outcomes]

    def _build(self) -> None:
        import cupy

        cfg = self.config
        rt = _rt()
        props = torch.cuda.get_device_properties(self.device_index)
        me = dict(host=socket.gethostname(), pid=os.getpid(), uuid=str(props.uuid),
                  settings=(cfg.max_bytes, cfg.one_shot_max_bytes, cfg.transport, cfg.algo, cfg.islands,
                            cfg.timeout_s),
                  visible=[str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())])
        infos = self._gather(me)
        if len({i["host"] for i in infos}) != 1:
            raise FastcommError("fastcomm workspaces span one node only; ranks are on "
                                f"{sorted({i['host'] for i in infos})}")
        if len({repr(i["settings"]) for i in infos}) != 1:
            raise FastcommError("fastcomm settings differ across ranks (FASTCOMM_* environment or arguments): "
                                + "; ".join(f"rank {r}: {i['settings']}" for r, i in enumerate(infos)))
        if len({i["uuid"] for i in infos}) != self.world_size:
            raise FastcommError("two ranks use the same GPU; fastcomm needs one GPU per rank")

        # P2P as seen from this process; the transport decision uses every rank's row, so all agree.
        row = []
        for r, info in enumerate(infos):
            if r == self.rank:
                row.append(True)
            elif info["uuid"] in me["visible"]:
                row.append(bool(torch.cuda.can_device_access_peer(self.device_index, me["visible"].index(info["uuid"]))))
            else:
                row.append(False)  # not visible here: CUDA IPC across isolated devices is not attempted
        p2p_rows = self._gather(row)
        all_p2p = all(all(r) for r in p2p_rows)
        if cfg.transport == "p2p" and not all_p2p:
            raise FastcommError(f"FASTCOMM_TRANSPORT=p2p but some GPU pairs cannot reach each other: {p2p_rows}")
        self.transport = Transport.P2P if (all_p2p and cfg.transport != "host") else Transport.HOST
        self.link, probed_islands = self._decide_topology([i["uuid"] for i in infos])
        islands = cfg.islands if cfg.islands else (probed_islands if self.transport is Transport.P2P else None)
        self.islands = policy.validate_islands(islands, self.world_size) if islands else None
        if self.islands is not None and self.transport is Transport.HOST:
            raise FastcommError("island (hierarchical) mode needs P2P; the host transport is flat by nature")
        self.rules, self.rules_source = self._decide_rules()
        self.layout = L.plan_layout(self.transport.value, self.world_size, cfg.max_bytes,
                                    min(cfg.one_shot_max_bytes, cfg.max_bytes), self.islands)
        self.num_sms = props.multi_processor_count
        self.max_blocks = min(policy.MAX_BLOCKS, cfg.max_blocks or self.num_sms)

        with cupy.cuda.Device(self.device_index):
            handles = self._all_ok("allocating device memory", lambda: self._allocate(rt))
            if self.transport is Transport.P2P:
                opened = self._all_ok("opening peer buffers (CUDA IPC)", lambda: self._open_peers(rt, handles))
                peer_bases, host_base = opened[self.rank], None
            else:
                peer_bases = None
                host_base = self._map_host_segment(rt)
            # The last agreement doubles as the barrier: everyone has mapped everything before any rank
            # returns and may write into a peer.
            self._all_ok("writing the peer tables", lambda: self._write_tables(rt, peer_bases, host_base))
        if self.rank == 0:
            log.info("%s", self.describe())

    def _decide_topology(self, uuids: list[str]) -> tuple[LinkType, tuple[tuple[int, ...], ...] | None]:
        """The worst link among this group's GPUs and, where the probe finds them, islands (only when the
        group spans CPU sockets: cross-socket P2P writes are the slow ones hierarchical mode avoids).
        Rank 0 probes; every rank uses its verdict, so all pick the same policy row."""

        def probe():
            from . import topology

            topo = topology.probe()
            pos = {_norm_uuid(g.uuid): i for i, g in enumerate(topo.gpus) if g.uuid}
            if not all(_norm_uuid(u) in pos for u in uuids):
                log.info("fastcomm: topology probe did not see every rank's GPU (%s); conservative policy",
                         "; ".join(topo.notes) or "UUIDs not matched")
                return LinkType.UNKNOWN.value, None
            ranks = [pos[_norm_uuid(u)] for u in uuids]
            link = topo.worst_link(ranks)
            groups = topology.islands(topo, ranks) if link is LinkType.CROSS_SOCKET else ()
            isl = tuple(tuple(ranks.index(p) for p in g) for g in groups) if len(groups) > 1 else None
            return link.value, isl

        (link, isl), err = self._decided_by_rank0(probe, (LinkType.UNKNOWN.value, None))
        if err and self.rank == 0:  # topology is advisory; the UNKNOWN row is conservative
            log.warning("fastcomm: topology probe failed (%s); using conservative defaults", err)
        return LinkType(link), isl

    def _decide_rules(self) -> tuple[tuple[policy.Rule, ...], str]:
        """Rank 0 reads the tune cache (if any); every rank runs the rules it chose."""
        from . import tuning

        def read():
            fp = tuning.fingerprint_here(self.transport, self.link, self.world_size, self.device_index)
            return tuning.rules_from_file(self.config, fp)

        (rules, why), err = self._decided_by_rank0(read, (None, ""))
        if err is not None:  # an explicit but unusable FASTCOMM_TUNE_FILE: fail on every rank alike
            raise tuning.TuneCacheError(err)
        if rules is None:
            return (policy.lookup_rules(policy.DEFAULT_TABLE, self.transport, self.link, self.world_size),
                    why or "defaults")
        return rules, why

    def _allocate(self, rt) -> bytes | None:
        """Error record, local state and (P2P) the shared buffer; returns the buffer's IPC handle."""
        res = self._res
        res.err_ptr = rt.hostAlloc(ctypes.sizeof(ErrorRecord), rt.hostAllocMapped | rt.hostAllocPortable)
        ctypes.memset(res.err_ptr, 0, ctypes.sizeof(ErrorRecord))
        self._err = ErrorRecord.from_address(res.err_ptr)
        res.local_buffer = rt.malloc(self.layout.local_bytes)
        rt.memset(res.local_buffer, 0, self.layout.local_bytes)
        if self.transport is not Transport.P2P:
            return None
        res.own_buffer = rt.malloc(self.layout.shared_bytes)
        rt.memset(res.own_buffer, 0, self.layout.shared_bytes)
        return bytes(rt.ipcGetMemHandle(res.own_buffer))

    def _open_peers(self, rt, handles: list) -> list[int]:
        res = self._res
        bases = []
        for r, h in enumerate(handles):
            if r == self.rank:
                bases.append(res.own_buffer)
            else:
                p = rt.ipcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess)
                res.peer_ptrs.append(p)
                bases.append(p)
        return bases

    def _write_tables(self, rt, peer_bases: list[int] | None, host_base: int | None) -> None:
        """One FcTable per group this rank belongs to, copied to its local device memory."""
        res, lay = self._res, self.layout
        own = peer_bases[self.rank] if peer_bases else 0
        self._tables = {}  # group id (FLAT / ISLAND / PARTNER) -> device table address
        blob = bytearray(lay.local_bytes - lay.table_off)
        for k, g in enumerate(L.groups_of(lay, self.rank)):
            gi = lay.groups.index(g)
            t = L.build_table(lay, g, self.rank, own_base=own, peer_bases=peer_bases, host_base=host_base,
                              state_ptr=res.local_buffer + lay.state_off + 16 * gi, err_ptr=res.err_ptr,
                              timeout_ns=int(self.config.timeout_s * 1e9),
                              scratch_ptr=res.local_buffer + lay.scratch_off + L.SCRATCH_BYTES * gi)
            off = L.TABLE_BYTES * k
            blob[off:off + L.TABLE_BYTES] = bytes(t)
            self._tables[g.group_id] = res.local_buffer + lay.table_off + off
        host_blob = (ctypes.c_char * len(blob)).from_buffer(blob)
        rt.memcpy(res.local_buffer + lay.table_off, ctypes.addressof(host_blob), len(blob), _H2D)
        del host_blob
        rt.deviceSynchronize()

    def _map_host_segment(self, rt) -> int:
        """One /dev/shm file mapped by every rank and registered with CUDA; unlinked as soon as all have it."""
        res = self._res
        size = self.layout.shared_bytes

        def create() -> str | None:
            if self.rank != 0:
                return None
            remove_stale_segments()
            path = SHM_DIR / f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            res.shm_path = path
            try:
                os.ftruncate(fd, size)  # zero-filled: no stale flags
            finally:
                os.close(fd)
            return str(path)

        def mmap(name: str) -> None:
            fd = os.open(name, os.O_RDWR)
            try:
                addr = _libc.mmap(None, size, PROT_RW, MAP_SHARED, fd, 0)
            finally:
                os.close(fd)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise FastcommError(f"mmap of {name} failed: {os.strerror(ctypes.get_errno())}")
            res.host_addr, res.host_size = addr, size

        def register() -> None:
            if not rt.deviceGetAttribute(rt.cudaDevAttrCanUseHostPointerForRegisteredMem, self.device_index):
                raise FastcommError("this GPU cannot use registered host pointers directly; no host transport")
            rt.hostRegister(res.host_addr, size, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED)
            res.host_registered = True

        name = self._all_ok("creating the host segment", create)[0]
        self._all_ok("mapping the host segment", lambda: mmap(name))
        if res.shm_path is not None:  # rank 0, once every rank has it mapped: nothing stays in /dev/shm
            res.shm_path.unlink(missing_ok=True)
            res.shm_path = None
        self._all_ok("registering the host segment with CUDA", register)
        return res.host_addr

    # ---- queries ----------------------------------------------------------------------------------

    def algo_for(self, nbytes: int, forced: str | None = None) -> Algo:
        return policy.choose_algo(nbytes, self.rules, one_shot_max_bytes=self.layout.one_shot_max_bytes,
                                  max_bytes=self.config.max_bytes, forced=forced or self.config.algo)

    def tensor_reason(self, x: torch.Tensor) -> str | None:
        """Why ``x`` is not a valid fastcomm input at all (device, dtype, layout, size), or None."""
        return policy.check_tensor(is_cuda=x.is_cuda, device_index=x.device.index, ws_device_index=self.device_index,
                                   dtype=_DTYPE_NAME.get(x.dtype, str(x.dtype)), contiguous=x.is_contiguous(),
                                   data_ptr=x.data_ptr(), nbytes=x.numel() * x.element_size(),
                                   max_bytes=self.config.max_bytes)

    def route(self, x: torch.Tensor) -> tuple[Algo | None, str | None]:
        """(algorithm, None) when fastcomm all-reduces ``x``, else (None, why not). The one routing decision,
        identical on every rank for the same shapes, dtypes and layouts."""
        if self.closed:
            return None, "workspace is closed"
        reason = self.tensor_reason(x)
        if reason is not None:
            return None, reason
        algo = self.algo_for(x.numel() * x.element_size())
        return (None, "policy sends this size to NCCL") if algo is Algo.NCCL else (algo, None)

    def why_not(self, x: torch.Tensor) -> str | None:
        """Why fastcomm cannot all-reduce ``x`` (None: it can)."""
        return self.route(x)[1]

    def can_all_reduce(self, x: torch.Tensor) -> bool:
        return self.why_not(x) is None

    def why_not_fused(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> str | None:
        if self.closed:
            return "workspace is closed"
        reason = self.tensor_reason(x)
        if reason or x.dim() < 1:
            return reason or "input must have a hidden dimension"
        if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                     or not residual.is_contiguous() or residual.device != x.device
                                     or residual.data_ptr() % policy.ALIGN):
            return "residual must match the input's shape, dtype and device, be contiguous and 16-byte aligned"
        hidden = x.shape[-1]
        return policy.check_fused(tokens=x.numel() // max(hidden, 1), hidden=hidden, elem_size=x.element_size(),
                                  one_shot_max_bytes=self.layout.one_shot_max_bytes)

    def can_fuse(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
        return self.why_not_fused(x, residual) is None

    def raise_if_failed(self) -> None:
        """Raise the device-side timeout, if one happened (cheap: one read of pinned host memory)."""
        if not self.closed and self._err.code:
            raise FastcommTimeoutError(describe(self._err, self.config.timeout_s))

    def error_message(self) -> str | None:
        return None if self.closed else describe(self._err, self.config.timeout_s)

    def describe(self) -> str:
        ranges, lo = [], 0
        for rule in self.rules:
            hi = min(rule.max_bytes, self.config.max_bytes)
            if hi > lo:
                algo = rule.algo
                if algo is Algo.ONE_SHOT and hi > self.layout.one_shot_max_bytes:
                    algo = Algo.TWO_SHOT
                ranges.append(f"{_fmt(lo)}-{_fmt(hi)}: {algo.value}")
                lo = hi
        ranges.append(f">{_fmt(lo)}: nccl")
        isl = f", islands {self.islands}" if self.islands else ""
        return (f"fastcomm: {self.world_size} ranks, transport {self.transport.value}, link {self.link.value}"
                f"{isl}; {'; '.join(ranges)} (policy: {self.rules_source})")

    def stream(self) -> int:
        """The caller's current stream on our device (raw handle; the fast accessor when torch has it)."""
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        return raw(self.device_index) if raw is not None else torch.cuda.current_stream(self.device).cuda_stream

    # ---- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Release every handle (IPC mappings, buffers, host segment). Idempotent; also runs at exit."""
        if self.closed:
            return
        self.closed = True
        _registry.pop(self.id, None)
        self._finalizer()

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _norm_uuid(u: str) -> str:
    """torch prints GPU UUIDs bare, NVML and nvidia-smi with a 'GPU-' prefix."""
    u = u.strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def _fmt(n: int) -> str:
    for unit, size in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"
