"""The workspace: buffers shared by every rank of a group, built collectively, released by ``close()``.

Collective contract: every rank of the group constructs the workspace together, then calls the same ops
with the same shapes, dtypes and algorithms in the same order (as with NCCL), and finally closes it.
Ranks that break the contract time out with an error naming the stalled peer; they never hang forever.

Construction, in three steps: the ranks agree on what they found (``handshake.gather_facts``), one pure
step turns facts and settings into a frozen plan (``policy.make_plan``: transport, link, islands, size
rules), and this module allocates and maps the memory of that plan and releases it. Ops are free functions
in ``fastcomm.ops`` that take a workspace and ask ``ws.plan``.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import os
import secrets
import threading
import types
import weakref
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from . import abi
from .runtime import jit, launch_ex
from . import layout as L
from . import policy
from .abi import GROUPS, STEPS, ErrorRecord
from .config import Config
from .errors import FastcommError, FastcommTimeoutError
from .handshake import Handshake, gather_facts
from .policy import Algo, Plan, Transport

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



def describe(rec: ErrorRecord, timeout_s: float) -> str | None:
    if rec.code == 0:
        return None
    step = STEPS.get(rec.step, f"step {rec.step}")
    group = GROUPS.get(rec.group, f"group {rec.group}")
    return (f"fastcomm: rank {rec.rank} timed out after {timeout_s:g} s waiting for peer rank {rec.peer} "
            f"in the {step} ({group}, call epoch {rec.epoch}, block {rec.block}). The peer is dead, stalled, "
            f"or called a different collective sequence (every rank must make the same calls in the same "
            f"order). The CUDA context is unusable after this error; restart the process.")


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
        self.watchers: list[threading.Thread] = []
        self.stop = threading.Event()  # set first on release: watchers stop reading the record before it is freed

    def release(self) -> None:
        self.stop.set()
        for t in self.watchers:
            t.join(timeout=2.0)
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
        from . import log as log_setup

        log_setup.setup(self.config)  # FASTCOMM_LOG: the build's one-line summary reaches stderr outside vLLM
        self.group = group if group is not None else dist.group.WORLD
        self._hs = Handshake(self.group)
        self.rank, self.world_size = self._hs.rank, self._hs.world_size
        if not 2 <= self.world_size <= abi.MAX_WORLD:
            raise FastcommError(f"fastcomm needs 2..{abi.MAX_WORLD} ranks, group has {self.world_size}")
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.type != "cuda":
            raise FastcommError(f"workspace device must be CUDA, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.device_index = self.device.index
        self.id = next(_ids)
        self._functions: dict[str, int] = {}  # kernel symbol -> CUfunction, all loaded at build
        self._tables: dict[int, int] = {}     # group id -> device address of this rank's FcTable
        self._tables_view = types.MappingProxyType(self._tables)  # read-only, live: no copy per call
        self._res = _Resources(self.device_index)
        self._finalizer = weakref.finalize(self, self._res.release)
        self.closed = False
        self._p2p_note = ""
        self._resident: dict[tuple[int, int, int], int] = {}  # (CUfunction, block, cluster) -> clusters resident
        try:
            self._build()
        except BaseException:
            self.closed = True
            try:
                self._finalizer()
            except Exception as cleanup:  # e.g. no driver: cleanup fails too, and must not hide the cause
                log.debug("fastcomm: cleanup after a failed build also failed: %s", cleanup)
            raise
        _registry[self.id] = self

    # ---- construction -----------------------------------------------------------------------------

    def _build(self) -> None:
        import cupy

        rt = _rt()
        facts = gather_facts(self._hs, self.device_index, self.config)
        self._p2p_note = facts.p2p_note
        self.plan: Plan = policy.make_plan(facts, self.config)
        self.layout = L.plan_layout(self.plan.transport.value, self.world_size, self.plan.max_bytes,
                                    self.plan.one_shot_max_bytes, self.plan.islands)
        all_ok = self._hs.all_ok
        with cupy.cuda.Device(self.device_index):
            # Every kernel is loaded (compiled on a cache miss) before the ranks agree the workspace is
            # built, so no first call waits on NVRTC while its peers' kernels spin against the deadline.
            all_ok("loading the kernels", self._load_kernels)
            handles = all_ok("allocating device memory", lambda: self._allocate(rt))
            if self.plan.transport is Transport.P2P:
                opened = all_ok("opening peer buffers (CUDA IPC)", lambda: self._open_peers(rt, handles))
                peer_bases, host_base = opened[self.rank], None
            else:
                peer_bases = None
                host_base = self._map_host_segment(rt)
            # The last agreement doubles as the barrier: everyone has mapped everything before any rank
            # returns and may write into a peer.
            all_ok("writing the peer tables", lambda: self._write_tables(rt, peer_bases, host_base))
        if self.rank == 0:
            log.info("%s", self.describe())

    def _load_kernels(self) -> None:
        for kernel in abi.KERNELS:
            for sym in kernel.symbols():
                self._functions[sym] = jit.function(self.device_index, self.config.cache_dir, sym)

    def _allocate(self, rt) -> bytes | None:
        """Error record, local state and (P2P) the shared buffer; returns the buffer's IPC handle."""
        res = self._res
        res.err_ptr = rt.hostAlloc(ctypes.sizeof(ErrorRecord), rt.hostAllocMapped | rt.hostAllocPortable)
        ctypes.memset(res.err_ptr, 0, ctypes.sizeof(ErrorRecord))
        self._err = ErrorRecord.from_address(res.err_ptr)
        res.local_buffer = rt.malloc(self.layout.local_bytes)
        rt.memset(res.local_buffer, 0, self.layout.local_bytes)
        if self.plan.transport is not Transport.P2P:
            return None
        res.own_buffer = rt.malloc(self.layout.shared_bytes)
        rt.memset(res.own_buffer, 0, self.layout.shared_bytes)
        for off, nbytes in getattr(self.layout, "sentinel_regions", ()):
            rt.memset(res.own_buffer + off, 0xFF, nbytes)  # "not arrived yet" for readiness-in-data slots
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
        blob = bytearray(lay.local_bytes - lay.table_off)
        for k, g in enumerate(L.groups_of(lay, self.rank)):
            gi = lay.groups.index(g)
            t = L.build_table(lay, g, self.rank, own_base=own, peer_bases=peer_bases, host_base=host_base,
                              state_ptr=res.local_buffer + lay.state_off + abi.STATE_BYTES * gi, err_ptr=res.err_ptr,
                              timeout_ns=int(self.config.timeout_s * 1e9),
                              scratch_ptr=res.local_buffer + lay.scratch_off + abi.SCRATCH_BYTES * gi)
            off = abi.TABLE_BYTES * k
            blob[off:off + abi.TABLE_BYTES] = bytes(t)
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

        def fill() -> None:
            if self.rank == 0:  # once, before any rank may write: every rank has mapped it, none has returned
                for off, nbytes in getattr(self.layout, "sentinel_regions", ()):
                    ctypes.memset(res.host_addr + off, 0xFF, nbytes)

        name = self._hs.all_ok("creating the host segment", create)[0]
        self._hs.all_ok("mapping the host segment", lambda: mmap(name))
        self._hs.all_ok("initialising the host segment", fill)
        if res.shm_path is not None:  # rank 0, once every rank has it mapped: nothing stays in /dev/shm
            res.shm_path.unlink(missing_ok=True)
            res.shm_path = None
        self._hs.all_ok("registering the host segment with CUDA", register)
        return res.host_addr

    # ---- queries ----------------------------------------------------------------------------------

    @property
    def transport(self) -> Transport:
        return self.plan.transport

    @property
    def islands(self) -> tuple[tuple[int, ...], ...] | None:
        return self.plan.islands

    @property
    def tables(self) -> Mapping[int, int]:
        """Group id (abi.FLAT / ISLAND / PARTNER) -> device address of this rank's table for that group."""
        return self._tables_view

    def function(self, kernel: abi.Kernel, dtype: str, variant: str = "") -> int:
        """The loaded CUfunction of ``kernel`` for ``dtype`` (a name in abi.DTYPE_SUFFIX)."""
        return self._functions[kernel.symbol(dtype, variant)]

    def resident_clusters(self, fn: int, block: int, cluster_blocks: int) -> int:
        """Clusters of ``cluster_blocks`` blocks of ``block`` threads of ``fn`` (one of this workspace's
        functions) that fit on its device at once: asked once per shape, kept as long as the module is."""
        key = (fn, block, cluster_blocks)
        if key not in self._resident:
            self._resident[key] = launch_ex.max_active_clusters(fn, block, cluster_blocks)
        return self._resident[key]

    def algo_for(self, nbytes: int, forced: str | None = None) -> Algo:
        return self.plan.algo_for(nbytes, forced)

    def tensor_reason(self, x: torch.Tensor) -> str | None:
        """Why ``x`` is not a valid fastcomm input at all (device, dtype, layout, size), or None."""
        return policy.check_tensor(is_cuda=x.is_cuda, device_index=x.device.index, ws_device_index=self.device_index,
                                   dtype=dtype_name(x.dtype), contiguous=x.is_contiguous(), data_ptr=x.data_ptr(),
                                   nbytes=x.numel() * x.element_size(), max_bytes=self.plan.max_bytes)

    def route(self, x: torch.Tensor) -> tuple[policy.Route | None, str | None]:
        """(route, None) when fastcomm all-reduces ``x``, else (None, why not): policy.allreduce_route's answer
        (algorithm, kernel, tables, launch shape) for a valid input, identical on every rank for the same
        shapes, dtypes and layouts."""
        if self.closed:
            return None, "workspace is closed"
        reason = self.tensor_reason(x)
        if reason is not None:
            return None, reason
        route = policy.allreduce_route(self.plan, x.numel() * x.element_size(), x.element_size())
        return (None, "policy sends this size to NCCL") if route.kernel is None else (route, None)

    def why_not(self, x: torch.Tensor) -> str | None:
        """Why fastcomm cannot all-reduce ``x`` (None: it can)."""
        return self.route(x)[1]

    def can_all_reduce(self, x: torch.Tensor) -> bool:
        return self.why_not(x) is None

    def fused_route(self, x: torch.Tensor, residual: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                    *, within_policy: bool = True, algo: str = "auto") -> tuple[policy.FusedAlgo | None, str | None]:
        """(fused kernel, None) when the fused all-reduce + RMSNorm takes these inputs, else (None, why not).
        The one input check of the fused op. ``within_policy`` (what routing callers such as the vLLM
        integration want) keeps to the plan's fused ranges (policy.choose_fused: the one-shot kernel in the
        one-shot's range, the two-shot kernel above it at >= 4 ranks), outside which all-reduce + norm is the
        path to take; ``fused_all_reduce_rmsnorm`` itself only refuses what cannot run (the buffers' limits).
        ``algo`` ("one_shot" / "two_shot"): that kernel wherever it can run."""
        if self.closed:
            return None, "workspace is closed"
        reason = self.tensor_reason(x)
        if reason or x.dim() < 1:
            return None, reason or "input must have a hidden dimension"
        if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                     or not residual.is_contiguous() or residual.device != x.device
                                     or residual.data_ptr() % abi.ALIGN):
            return None, "residual must match the input's shape, dtype and device, be contiguous and 16-byte aligned"
        hidden = x.shape[-1]
        if weight is not None and (weight.shape != (hidden,) or weight.dtype != x.dtype or weight.device != x.device
                                   or not weight.is_contiguous()):
            return None, f"weight must be a contiguous {x.dtype} vector of {hidden} elements on {x.device}"
        try:
            return policy.choose_fused(
                tokens=x.numel() // max(hidden, 1), hidden=hidden, elem_size=x.element_size(),
                world=self.world_size, host=self.transport is Transport.HOST, islands=self.plan.islands is not None,
                fused_max_bytes=self.plan.fused_max_bytes, one_shot_max_bytes=self.plan.one_shot_max_bytes,
                slot_bytes=self.layout.groups[0].lp_slot, within_policy=within_policy, forced=algo)
        except ValueError as e:
            return None, str(e)

    def why_not_fused(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                      weight: torch.Tensor | None = None, *, within_policy: bool = True) -> str | None:
        """Why the fused all-reduce + RMSNorm should not take these inputs (None: it should); see fused_route."""
        return self.fused_route(x, residual, weight, within_policy=within_policy)[1]

    def can_fuse(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None, *, within_policy: bool = True) -> bool:
        return self.why_not_fused(x, residual, weight, within_policy=within_policy) is None

    def raise_if_failed(self) -> None:
        """Raise the device-side timeout, if one happened (cheap: one read of pinned host memory)."""
        if not self.closed and self._err.code:
            raise FastcommTimeoutError(describe(self._err, self.config.timeout_s))

    def error_message(self) -> str | None:
        return None if self.closed else describe(self._err, self.config.timeout_s)

    def watch(self, callback, interval_s: float = 0.05) -> None:
        """Call ``callback(message)`` once, from a daemon thread, as soon as a kernel of this workspace records a
        device-side timeout. The record is pinned host memory, readable while the CUDA context is dead, so
        the message naming rank, peer and step reaches the log even when CUDA's own error surfaces elsewhere
        (a later sync, another library) as a generic launch failure."""
        if self.closed:
            return
        t = threading.Thread(target=watch_record, args=(self._err, self.config.timeout_s, self._res.stop, callback,
                                                         interval_s), name=f"fastcomm-watch-{self.id}", daemon=True)
        self._res.watchers.append(t)
        t.start()

    def describe(self) -> str:
        return self.plan.describe() + (f"; {self._p2p_note}" if self._p2p_note else "")

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


def watch_record(err: ErrorRecord, timeout_s: float, stop: threading.Event, callback, interval_s: float) -> None:
    """The watcher's loop: ``callback(message)`` once when ``err`` records a timeout; returns when ``stop`` is
    set (release sets it, and waits for this loop, before the record's memory is freed). Holds no reference
    to the workspace, so a forgotten workspace is still collected and released."""
    while not stop.is_set():
        msg = describe(err, timeout_s)
        if msg is not None:
            callback(msg)
            return
        stop.wait(interval_s)


def translate_error(exc: BaseException | None = None) -> FastcommTimeoutError | None:
    """The FastcommTimeoutError (naming rank, peer and step) behind ``exc`` when an open workspace of this
    process recorded a device-side timeout, else None. For callers that see CUDA's generic "unspecified
    launch failure" after a fastcomm kernel trapped: ``raise fastcomm.translate_error(e) or e``."""
    for ws in list(_registry.values()):
        msg = ws.error_message()
        if msg is not None:
            err = FastcommTimeoutError(msg)
            if exc is not None:
                err.__cause__ = exc
            return err
    return None


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the names abi.DTYPE_SUFFIX and the policy use."""
    return str(dtype).removeprefix("torch.")
