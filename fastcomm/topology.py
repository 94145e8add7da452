"""GPU topology: which pairs can reach each other and over what link.

The probe, and nothing else: it records facts and decides nothing (link classes are the policy layer's
vocabulary, ``fastcomm.policy.links``, and so are islands, the worst link and the P2P summary). Three parts,
so that everything but the last can be tested from recorded outputs on a machine without GPUs:
- plain data: ``GpuInfo`` and ``Topology`` (frozen, JSON round-trip);
- parsers of ``nvidia-smi`` text;
- ``probe``: the only code that touches the machine (NVML, else nvidia-smi), with every reader injectable.

Positions are ranks: ``topo.gpus[i]`` is CUDA device ``i`` of this process (after CUDA_VISIBLE_DEVICES), while
``GpuInfo.index`` keeps the machine-wide index that nvidia-smi and NVML print.
"""
from __future__ import annotations

import csv
import dataclasses
import importlib
import itertools
import os
import re
import subprocess
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from .policy.links import LinkType

SOURCES = ("nvml", "nvidia-smi", "none", "recorded")

Matrix = tuple[tuple[LinkType, ...], ...]
BoolMatrix = tuple[tuple["bool | None", ...], ...]


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    index: int                 # machine-wide (nvidia-smi / NVML, PCI bus order), not the CUDA ordinal
    name: str = ""             # "" when not read (e.g. a recorded `topo -m` alone)
    pci_bus_id: str = ""       # as NVML prints it, e.g. 00000000:01:00.0; "" when not read
    uuid: str | None = None
    numa_node: int | None = None  # the CPU NUMA node nearest the GPU (sysfs numa_node / 'NUMA Affinity')
    # Current link: idle GPUs train down (often to gen 1), so it only means something under load.
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_max: int | None = None
    compute_capability: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class Topology:
    """What the probe found. ``link[i][j]`` and ``p2p[i][j]`` are for ranks i and j; diagonals are never read."""

    gpus: tuple[GpuInfo, ...] = ()
    link: Matrix = ()
    p2p: BoolMatrix = ()  # P2P write from i to j; None where it could not be read
    source: str = "none"
    notes: tuple[str, ...] = ()  # what could not be read, and why

    def __post_init__(self):
        n = len(self.gpus)
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        for name in ("link", "p2p"):
            m = getattr(self, name)
            if len(m) != n or any(len(row) != n for row in m):
                raise ValueError(f"{name} must be a {n}x{n} matrix")

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "notes": list(self.notes),
            "gpus": [dataclasses.asdict(g) for g in self.gpus],
            "link": [[lt.value for lt in row] for row in self.link],
            "p2p": [list(row) for row in self.p2p],
        }

    @classmethod
    def from_json(cls, data: Mapping) -> "Topology":
        known = {f.name for f in dataclasses.fields(GpuInfo)}
        gpus = []
        for g in data.get("gpus", ()):
            g = {k: v for k, v in g.items() if k in known}  # tolerate fields added by later versions
            if g.get("compute_capability") is not None:
                g["compute_capability"] = tuple(g["compute_capability"])
            gpus.append(GpuInfo(**g))
        return cls(gpus=tuple(gpus),
                   link=tuple(tuple(LinkType(v) for v in row) for row in data.get("link", ())),
                   p2p=tuple(tuple(row) for row in data.get("p2p", ())),
                   source=data.get("source", "recorded"), notes=tuple(data.get("notes", ())))


def restrict(topo: Topology, positions: Sequence[int], note: str | None = None) -> Topology:
    """The topology seen by a process that uses only ``positions``, in that order."""
    return Topology(gpus=tuple(topo.gpus[i] for i in positions),
                    link=tuple(tuple(topo.link[i][j] for j in positions) for i in positions),
                    p2p=tuple(tuple(topo.p2p[i][j] for j in positions) for i in positions),
                    source=topo.source, notes=topo.notes + ((note,) if note else ()))


# ---------------------------------------------------------------------------------------------------------
# nvidia-smi text
# ---------------------------------------------------------------------------------------------------------

# nvidia-smi underlines the header row with ANSI escapes (even when piped, on some drivers).
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GPU_LABEL = re.compile(r"GPU(\d+)")
_TRAILING_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
# PIX/PXB stay below the host bridge; PHB/NODE cross the root complex of one CPU; SYS (SOC on old drivers)
# crosses the inter-socket link, which on AMD NPS>1 also means crossing NUMA nodes of one socket.
_SMI_LINKS = {"PIX": LinkType.PCIE_SWITCH, "PXB": LinkType.PCIE_SWITCH, "PHB": LinkType.HOST_BRIDGE,
              "NODE": LinkType.HOST_BRIDGE, "SYS": LinkType.CROSS_SOCKET, "SOC": LinkType.CROSS_SOCKET}
# `topo -p2p` codes: OK, then the reasons it is not (CNS chipset, GNS GPU, TNS topology, NS, DR regkey...).
_P2P_YES, _P2P_UNKNOWN = frozenset({"OK", "X"}), frozenset({"U"})


def link_from_smi(token: str) -> LinkType:
    token = token.strip().upper()
    if re.fullmatch(r"NV\d+", token):
        return LinkType.NVLINK
    return _SMI_LINKS.get(token, LinkType.UNKNOWN)


@dataclasses.dataclass(frozen=True)
class _Table:
    columns: tuple[str, ...]                     # device labels: GPU#, NIC# (or mlx5_# on old drivers)
    trailing: tuple[str, ...]                    # the affinity columns present, in header order
    rows: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...]  # (label, cells, trailing values)


def _read_table(text: str) -> _Table:
    """The device matrix of `nvidia-smi topo -m` / `topo -p2p`, whatever the tabs, spaces and legend.

    Splits on any whitespace: nvidia-smi pads with extra tabs (so tab positions are no guide) and copies
    from terminals turn tabs into spaces; no cell value contains a space, only the trailing column names.
    """
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header_at = next((i for i, line in enumerate(lines) if "GPU0" in line.split()), None)
    if header_at is None:
        raise ValueError("no GPU0 column in the nvidia-smi table")
    header = lines[header_at]
    found = sorted((header.find(name), name) for name in _TRAILING_COLUMNS if name in header)
    columns = tuple(header[:found[0][0]].split() if found else header.split())
    rows = []
    for line in lines[header_at + 1:]:
        tokens = line.split()
        if not tokens or tokens[0] not in columns:  # blank line, then the legend
            break
        cells = tuple(tokens[1:1 + len(columns)])
        if len(cells) < len(columns):
            raise ValueError(f"row {tokens[0]} has {len(cells)} cells, expected {len(columns)}")
        rows.append((tokens[0], cells, tuple(tokens[1 + len(columns):])))
    return _Table(columns, tuple(name for _, name in found), tuple(rows))


def _gpu_rows(table: _Table) -> tuple[tuple[str, ...], list[tuple[tuple[str, ...], tuple[str, ...]]]]:
    """GPU labels in row order and, per GPU row, its GPU-to-GPU cells and trailing values (NICs dropped)."""
    gpu_cols = [i for i, c in enumerate(table.columns) if _GPU_LABEL.fullmatch(c)]
    rows = [(label, cells, rest) for label, cells, rest in table.rows if _GPU_LABEL.fullmatch(label)]
    labels = tuple(label for label, _, _ in rows)
    if sorted(labels) != sorted(table.columns[i] for i in gpu_cols):
        raise ValueError(f"GPU rows {labels} do not match GPU columns")
    order = [table.columns.index(label) for label in labels]  # columns in the same order as the rows
    return labels, [(tuple(cells[i] for i in order), rest) for _, cells, rest in rows]


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text)  # 'N/A', '0-1' (several NUMA nodes), missing: not one number
    except (TypeError, ValueError):
        return None


def parse_nvidia_smi_topo(text: str) -> tuple[tuple[str, ...], Matrix, tuple[int | None, ...]]:
    """`nvidia-smi topo -m` -> (GPU labels, link matrix between GPUs, NUMA node per GPU or None).

    NIC rows and columns are dropped; the NUMA node is the 'NUMA Affinity' column (the CPU node near the GPU),
    not 'GPU NUMA ID' (the GPU's own memory node on coherent systems).
    """
    table = _read_table(text)
    labels, rows = _gpu_rows(table)
    matrix = tuple(tuple(link_from_smi(c) for c in cells) for cells, _ in rows)
    numa = tuple(_int_or_none(dict(zip(table.trailing, rest)).get("NUMA Affinity")) for _, rest in rows)
    return labels, matrix, numa


def parse_nvidia_smi_p2p(text: str) -> tuple[tuple[str, ...], BoolMatrix]:
    """`nvidia-smi topo -p2p w` (or r, rw...) -> (GPU labels, matrix: True for OK, None for U(nknown))."""
    labels, rows = _gpu_rows(_read_table(text))
    return labels, tuple(tuple(True if c.upper() in _P2P_YES else None if c.upper() in _P2P_UNKNOWN else False
                               for c in cells) for cells, _ in rows)


# The fields of `nvidia-smi --query-gpu`; compute_cap needs a driver from 2022 on, hence the fallback.
QUERY_FIELDS = ("index", "name", "pci.bus_id", "uuid", "pcie.link.gen.current", "pcie.link.width.current",
                "pcie.link.gen.max", "pcie.link.width.max", "compute_cap")
QUERY_FIELDS_OLD = QUERY_FIELDS[:-1]


def _query_value(text: str) -> str | None:
    return None if text.startswith("[") or text in ("", "N/A") else text  # [N/A], [Not Supported]


def parse_gpu_query(text: str, fields: Sequence[str] = QUERY_FIELDS) -> tuple[GpuInfo, ...]:
    """`nvidia-smi --query-gpu=<fields> --format=csv,noheader` -> GpuInfo per line (numa_node left None)."""
    gpus = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if not row:
            continue
        if len(row) != len(fields):
            raise ValueError(f"query row {row} has {len(row)} values, expected {len(fields)}")
        v = {f: _query_value(x.strip()) for f, x in zip(fields, row)}
        cc, index = v.get("compute_cap"), _int_or_none(v["index"])
        if index is None:
            raise ValueError(f"query row {row} has no GPU index")
        gpus.append(GpuInfo(
            index=index, name=v["name"] or "", pci_bus_id=v["pci.bus_id"] or "", uuid=v["uuid"],
            pcie_gen=_int_or_none(v["pcie.link.gen.current"]), pcie_width=_int_or_none(v["pcie.link.width.current"]),
            pcie_gen_max=_int_or_none(v["pcie.link.gen.max"]), pcie_width_max=_int_or_none(v["pcie.link.width.max"]),
            compute_capability=tuple(int(p) for p in cc.split(".")) if cc else None))
    return tuple(gpus)


def topology_from_nvidia_smi(topo_text: str, p2p_text: str | None = None, query_text: str | None = None, *,
                             query_fields: Sequence[str] = QUERY_FIELDS, source: str = "nvidia-smi",
                             notes: Iterable[str] = ()) -> Topology:
    """A Topology from recorded nvidia-smi outputs; ``topo -m`` is required, the other two fill in details."""
    notes = list(notes)
    labels, link, numa = parse_nvidia_smi_topo(topo_text)
    indices = [int(_GPU_LABEL.fullmatch(label).group(1)) for label in labels]
    queried = {}
    if not query_text:
        notes.append("GPU names, bus ids and PCIe links not read (no nvidia-smi --query-gpu output)")
    else:
        try:
            queried = {g.index: g for g in parse_gpu_query(query_text, query_fields)}
        except ValueError as e:  # the link matrix is what matters; keep it without the details
            notes.append(f"nvidia-smi --query-gpu output not understood: {e}")
    gpus = tuple(dataclasses.replace(queried.get(idx, GpuInfo(index=idx)), numa_node=node)
                 for idx, node in zip(indices, numa))
    if any(lt is LinkType.UNKNOWN for _, lt in _off_diagonal(link)):
        notes.append("unrecognised link codes in nvidia-smi topo -m; treated as unknown")
    p2p = None
    if p2p_text is not None:
        try:
            p2p_labels, p2p_matrix = parse_nvidia_smi_p2p(p2p_text)
        except ValueError as e:
            p2p_labels, p2p_matrix = (), None
            notes.append(f"nvidia-smi topo -p2p w output not understood: {e}")
        if p2p_labels == labels:
            p2p = p2p_matrix
        elif p2p_matrix is not None:
            notes.append(f"nvidia-smi topo -p2p lists {p2p_labels}, topo -m {labels}; P2P ignored")
    if p2p is None:
        p2p = _unknown_p2p(len(labels))
        if p2p_text is None:
            notes.append("P2P access not read (no nvidia-smi topo -p2p w output)")
    return Topology(gpus=gpus, link=link, p2p=p2p, source=source, notes=tuple(notes))


def _unknown_p2p(n: int) -> BoolMatrix:
    return tuple(tuple(True if i == j else None for j in range(n)) for i in range(n))


def _off_diagonal(matrix):
    return [((i, j), v) for i, row in enumerate(matrix) for j, v in enumerate(row) if i != j]


# ---------------------------------------------------------------------------------------------------------
# Probing the machine
# ---------------------------------------------------------------------------------------------------------

Runner = Callable[..., subprocess.CompletedProcess]

# NVML enum values (stable C ABI), named as in nvml.h / pynvml.
_NVML_LEVELS = {0: LinkType.PCIE_SWITCH,    # NVML_TOPOLOGY_INTERNAL (same board)
                10: LinkType.PCIE_SWITCH,   # NVML_TOPOLOGY_SINGLE
                20: LinkType.PCIE_SWITCH,   # NVML_TOPOLOGY_MULTIPLE
                30: LinkType.HOST_BRIDGE,   # NVML_TOPOLOGY_HOSTBRIDGE
                40: LinkType.HOST_BRIDGE,   # NVML_TOPOLOGY_NODE
                50: LinkType.CROSS_SOCKET}  # NVML_TOPOLOGY_SYSTEM
_NVML_P2P_WRITE = 1      # NVML_P2P_CAPS_INDEX_WRITE
_NVML_P2P_NVLINK = 2     # NVML_P2P_CAPS_INDEX_NVLINK
_NVML_P2P_OK = 0         # NVML_P2P_STATUS_OK
_NVML_ENABLED = 1        # NVML_FEATURE_ENABLED
_NVML_SCOPE_NODE = 0     # NVML_AFFINITY_SCOPE_NODE
SYSFS_PCI = "/sys/bus/pci/devices"


def _import_pynvml():
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def probe(run: Runner = subprocess.run, *, env: Mapping[str, str] | None = None,
          nvml_loader: Callable[[], object] = _import_pynvml, sysfs_pci: str = SYSFS_PCI) -> Topology:
    """Read this machine's GPU topology. Never raises for a missing GPU, driver, NVML or nvidia-smi:
    the result is then empty and its notes say why.

    NVML first (exact, no subprocess); `nvidia-smi` otherwise. ``run`` and ``nvml_loader`` are injectable so
    tests feed recorded outputs; ``env`` supplies CUDA_VISIBLE_DEVICES (default: this process's).
    """
    env = os.environ if env is None else env
    topo, nvml_notes = _probe_nvml(nvml_loader, sysfs_pci)
    if topo is None:
        topo, smi_notes = _probe_nvidia_smi(run, sysfs_pci)
        if topo is None:
            return Topology(source="none", notes=nvml_notes + smi_notes)
        topo = dataclasses.replace(topo, notes=nvml_notes + topo.notes)
    return apply_visible_devices(topo, env)


def _read_numa(sysfs_pci: str, bus_id: str) -> int | None:
    """NUMA node from sysfs; the directory uses a 4-digit domain and lower case (0000:01:00.0)."""
    parts = bus_id.split(":")
    if len(parts) != 3:
        return None
    try:
        path = Path(sysfs_pci) / f"{int(parts[0], 16):04x}:{parts[1].lower()}:{parts[2].lower()}" / "numa_node"
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None  # -1: the platform did not say


def _probe_nvml(loader, sysfs_pci) -> tuple[Topology | None, tuple[str, ...]]:
    try:
        nvml = loader()
    except Exception as e:  # a broken install must not stop the fallback
        return None, (f"NVML: importing pynvml failed: {e}",)
    if nvml is None:
        return None, ('NVML: pynvml is not installed (pip install nvidia-ml-py, or the nvml extra: pip install -e ".[nvml]")',)
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded: no driver here
        return None, (f"NVML: nvmlInit failed: {e}",)
    try:
        return _read_nvml(nvml, sysfs_pci), ()
    except Exception as e:  # anything NVML refuses mid-way: fall back rather than half-fill
        return None, (f"NVML: reading the topology failed: {type(e).__name__}: {e}",)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _opt(fn, *args):
    """Calls NVML for something optional: consumer GPUs answer NotSupported for NVLink, MIG for PCIe..."""
    try:
        return fn(*args)
    except Exception:
        return None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _read_nvml(nvml, sysfs_pci: str) -> Topology:
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    gpus = []
    for i, h in enumerate(handles):
        bus = _text(nvml.nvmlDeviceGetPciInfo(h).busId)
        cc = _opt(nvml.nvmlDeviceGetCudaComputeCapability, h)
        uuid = _opt(nvml.nvmlDeviceGetUUID, h)
        gpus.append(GpuInfo(
            index=i, name=_text(nvml.nvmlDeviceGetName(h)), pci_bus_id=bus,
            uuid=_text(uuid) if uuid is not None else None, numa_node=_nvml_numa(nvml, h, sysfs_pci, bus),
            pcie_gen=_opt(nvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
            pcie_width=_opt(nvml.nvmlDeviceGetCurrPcieLinkWidth, h),
            pcie_gen_max=_opt(nvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
            pcie_width_max=_opt(nvml.nvmlDeviceGetMaxPcieLinkWidth, h),
            compute_capability=tuple(cc) if cc is not None else None))
    max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)
    nvlinked = [_has_active_nvlink(nvml, h, max_links) for h in handles]
    n = len(handles)
    link, p2p, notes = [[LinkType.UNKNOWN] * n for _ in range(n)], [[True] * n for _ in range(n)], []
    for i, j in itertools.permutations(range(n), 2):
        # NVLink through an NVSwitch has no peer GPU at the link's far end, so ask P2P-over-NVLink instead.
        if nvlinked[i] and nvlinked[j] and _opt(nvml.nvmlDeviceGetP2PStatus, handles[i], handles[j],
                                                _NVML_P2P_NVLINK) == _NVML_P2P_OK:
            link[i][j] = LinkType.NVLINK
        else:
            level = _opt(nvml.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j])
            link[i][j] = _NVML_LEVELS.get(level, LinkType.UNKNOWN)
        status = _opt(nvml.nvmlDeviceGetP2PStatus, handles[i], handles[j], _NVML_P2P_WRITE)
        p2p[i][j] = None if status is None else status == _NVML_P2P_OK
    if any(v is LinkType.UNKNOWN for _, v in _off_diagonal(link)):
        notes.append("NVML: common ancestor not readable for some pairs; their link is unknown")
    if any(v is None for _, v in _off_diagonal(p2p)):
        notes.append("NVML: P2P write status not readable for some pairs")
    return Topology(gpus=tuple(gpus), link=tuple(map(tuple, link)), p2p=tuple(map(tuple, p2p)), source="nvml",
                    notes=tuple(notes) + _missing_field_notes(gpus))


def _nvml_numa(nvml, handle, sysfs_pci: str, bus_id: str) -> int | None:
    """sysfs first; VMs often leave it at -1, where NVML's memory affinity (what nvidia-smi prints) still
    names the node. A mask of several nodes is no single answer."""
    node = _read_numa(sysfs_pci, bus_id)
    if node is not None:
        return node
    mask = _opt(nvml.nvmlDeviceGetMemoryAffinity, handle, 4, _NVML_SCOPE_NODE)
    nodes = [64 * w + b for w, word in enumerate(mask or ()) for b in range(64) if int(word) >> b & 1]
    return nodes[0] if len(nodes) == 1 else None


def _has_active_nvlink(nvml, handle, max_links: int) -> bool:
    for link in range(max_links):
        state = _opt(nvml.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:  # NotSupported (no NVLink) or past this GPU's last link
            return False
        if state == _NVML_ENABLED:
            return True
    return False


def _missing_field_notes(gpus: Sequence[GpuInfo]) -> tuple[str, ...]:
    notes = []
    for field, what, why in (
            ("numa_node", "NUMA node unknown", " (no single node from sysfs, NVML or nvidia-smi)"),
            ("pcie_gen", "current PCIe link not readable", ""),
            ("pcie_gen_max", "maximum PCIe link not readable", ""),
            ("compute_capability", "compute capability not readable", "")):
        missing = [str(g.index) for g in gpus if getattr(g, field) is None]
        if missing:
            notes.append(f"{what} for GPU {', '.join(missing)}{why}")
    return tuple(notes)


def _run_smi(run: Runner, args: Sequence[str]) -> tuple[str | None, str]:
    """(stdout, "") on success, else (None, why) — nvidia-smi prints its errors on stdout."""
    argv = ["nvidia-smi", *args]
    try:
        r = run(argv, capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        return None, "nvidia-smi not found (no NVIDIA driver installed?)"
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{' '.join(argv)}: {type(e).__name__}: {e}"
    if r.returncode != 0:
        lines = (r.stdout or r.stderr or "").strip().splitlines()
        return None, f"{' '.join(argv)} failed (exit {r.returncode}): {lines[0] if lines else 'no output'}"
    return r.stdout, ""


def _probe_nvidia_smi(run: Runner, sysfs_pci: str) -> tuple[Topology | None, tuple[str, ...]]:
    topo_text, why = _run_smi(run, ["topo", "-m"])
    if topo_text is None:
        return None, (why,)
    notes = []
    fields = QUERY_FIELDS
    query_text, why = _run_smi(run, [f"--query-gpu={','.join(fields)}", "--format=csv,noheader"])
    if query_text is None:  # older drivers reject compute_cap: ask again without it
        fields = QUERY_FIELDS_OLD
        query_text, why = _run_smi(run, [f"--query-gpu={','.join(fields)}", "--format=csv,noheader"])
        if query_text is None:
            notes.append(why)
    p2p_text, why = _run_smi(run, ["topo", "-p2p", "w"])
    if p2p_text is None:
        notes.append(why)
    try:
        topo = topology_from_nvidia_smi(topo_text, p2p_text, query_text, query_fields=fields, notes=notes)
    except ValueError as e:
        return None, (f"could not parse nvidia-smi output: {e}",)
    # 'NUMA Affinity' is N/A on some boards and absent on old drivers: ask sysfs before giving up.
    gpus = tuple(g if g.numa_node is not None else
                 dataclasses.replace(g, numa_node=_read_numa(sysfs_pci, g.pci_bus_id)) for g in topo.gpus)
    return dataclasses.replace(topo, gpus=gpus, notes=topo.notes + _missing_field_notes(gpus)), ()


def apply_visible_devices(topo: Topology, env: Mapping[str, str]) -> Topology:
    """The GPUs this process sees, in CUDA order, per CUDA_VISIBLE_DEVICES.

    Like CUDA, entries after the first invalid one are ignored. Indices are matched to the machine-wide
    index, which is CUDA's order only with CUDA_DEVICE_ORDER=PCI_BUS_ID or identical GPUs (noted otherwise).
    UUID entries are matched by prefix when UUIDs were read; MIG entries and unmatched UUIDs leave all GPUs.
    """
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not topo.gpus:
        return topo
    positions: list[int] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.startswith(("GPU-", "MIG-")):
            hits = [p for p, g in enumerate(topo.gpus) if g.uuid and g.uuid.startswith(entry)]
            if entry.startswith("MIG-") or len(hits) != 1:
                return dataclasses.replace(topo, notes=topo.notes + (
                    f"CUDA_VISIBLE_DEVICES entry {entry!r} could not be mapped to one GPU; showing all GPUs",))
            p = hits[0]
        else:
            by_index = {g.index: p for p, g in enumerate(topo.gpus)}
            p = by_index.get(int(entry)) if re.fullmatch(r"\d+", entry) else None
        if p is None or p in positions:
            break
        positions.append(p)
    if positions == list(range(len(topo.gpus))):
        return topo
    shown = ", ".join(str(topo.gpus[p].index) for p in positions)
    note = f"CUDA_VISIBLE_DEVICES={visible!r}: " + (f"ranks are GPU {shown}" if positions else "no GPU visible")
    if len({g.name for g in topo.gpus}) > 1 and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        note += " (mixed GPU models without CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA may order them differently)"
    return restrict(topo, positions, note)
