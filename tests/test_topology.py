"""Topology probe on the CPU: parsing recorded nvidia-smi outputs, islands, probe() with injected readers, CLI.

The recordings in tests/data/topo are described in its README. No GPU, NVML or torch is needed here.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fastcomm import policy, topology
from fastcomm.commands import topo as topo_cli
from fastcomm.config import VARIABLES, Config
from fastcomm.policy import LinkType
from fastcomm.topology import GpuInfo, Topology

DATA = Path(__file__).parent / "data" / "topo"
PRO, RTX4090, H100 = "rtxpro6000_8gpu_2sock", "rtx4090_4gpu_nop2p", "h100_8gpu_nvlink"
NV, SW, HB, XS, UNK = (LinkType.NVLINK, LinkType.PCIE_SWITCH, LinkType.HOST_BRIDGE, LinkType.CROSS_SOCKET,
                       LinkType.UNKNOWN)


def text(name: str) -> str:
    return (DATA / name).read_text()


def recorded(box: str) -> Topology:
    return topology.topology_from_nvidia_smi(text(f"{box}.topo.txt"), text(f"{box}.p2p.txt"),
                                             text(f"{box}.query.csv"))


def off_diagonal(matrix):
    return [v for i, row in enumerate(matrix) for j, v in enumerate(row) if i != j]


# --------------------------------------------------------------------------------------------- parsing

def test_parse_two_socket_pcie_box_drops_nics():
    labels, link, numa = topology.parse_nvidia_smi_topo(text(f"{PRO}.topo.txt"))
    assert labels == tuple(f"GPU{i}" for i in range(8))
    assert numa == (0, 0, 0, 0, 1, 1, 1, 1)
    socket = lambda i: i // 4  # noqa: E731
    for i in range(8):
        for j in range(8):
            if i == j:
                continue
            want = SW if i // 2 == j // 2 else HB if socket(i) == socket(j) else XS
            assert link[i][j] is want, (i, j)


def test_parse_4090_copied_with_spaces():
    labels, link, numa = topology.parse_nvidia_smi_topo(text(f"{RTX4090}.topo.txt"))
    assert "\t" not in text(f"{RTX4090}.topo.txt")
    assert labels == ("GPU0", "GPU1", "GPU2", "GPU3")
    assert set(off_diagonal(link)) == {HB}  # PHB and NODE are one class
    assert numa == (0, 0, 0, 0)


def test_parse_nvlink_box_with_ansi_header():
    assert "\x1b[4m" in text(f"{H100}.topo.txt")
    labels, link, numa = topology.parse_nvidia_smi_topo(text(f"{H100}.topo.txt"))
    assert len(labels) == 8
    assert set(off_diagonal(link)) == {NV}
    assert numa == (0, 0, 0, 0, 1, 1, 1, 1)


def test_parse_old_driver_layout():
    # Pre-NIC-label drivers: the NIC column is named after the device, SOC meant SYS, no NUMA column.
    old = ("        GPU0    GPU1    GPU2    mlx4_0  CPU Affinity\n"
           "GPU0     X      PIX     SOC     PHB     0-9,20-29\n"
           "GPU1    PIX      X      SOC     PHB     0-9,20-29\n"
           "GPU2    SOC     SOC      X      SOC     10-19,30-39\n"
           "mlx4_0  PHB     PHB     SOC      X\n"
           "\n"
           "Legend:\n\n  X   = Self\n  SOC  = Connection traversing PCIe as well as the SMP link between CPU sockets\n")
    labels, link, numa = topology.parse_nvidia_smi_topo(old)
    assert labels == ("GPU0", "GPU1", "GPU2")
    assert (link[0][1], link[0][2], link[2][1]) == (SW, XS, XS)
    assert numa == (None, None, None)


def test_parse_unknown_code_and_numa_na():
    t = "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tNVB\t0-7\tN/A\nGPU1\tNVB\t X \t0-7\tN/A\n"
    labels, link, numa = topology.parse_nvidia_smi_topo(t)
    assert link[0][1] is UNK and numa == (None, None)
    topo = topology.topology_from_nvidia_smi(t)
    assert any("unrecognised" in n for n in topo.notes)


@pytest.mark.parametrize("bad", ["No devices were found\n", "", "\tGPU0\tGPU1\nGPU0\t X \n"])
def test_parse_rejects_non_tables(bad):
    with pytest.raises(ValueError):
        topology.parse_nvidia_smi_topo(bad)


def test_parse_p2p_recordings():
    labels, ok = topology.parse_nvidia_smi_p2p(text(f"{PRO}.p2p.txt"))
    assert labels == tuple(f"GPU{i}" for i in range(8)) and set(off_diagonal(ok)) == {True}
    labels, ok = topology.parse_nvidia_smi_p2p(text(f"{RTX4090}.p2p.txt"))
    assert len(labels) == 4 and set(off_diagonal(ok)) == {False}
    labels, ok = topology.parse_nvidia_smi_p2p(text(f"{H100}.p2p.txt"))  # ANSI-underlined header
    assert len(labels) == 8 and set(off_diagonal(ok)) == {True}


def test_parse_p2p_codes():
    t = (" \tGPU0\tGPU1\tGPU2\t\n GPU0\tX\tGNS\tU\t\n GPU1\tCNS\tX\tOK\t\n GPU2\tTNS\tOK\tX\t\n"
         "\nLegend:\n\n  X    = Self\n")
    _, ok = topology.parse_nvidia_smi_p2p(t)
    assert ok == ((True, False, None), (False, True, True), (False, True, True))


def test_parse_gpu_query():
    gpus = topology.parse_gpu_query(text(f"{PRO}.query.csv"))
    assert [g.index for g in gpus] == list(range(8))
    g = gpus[2]
    assert g.name == "NVIDIA RTX PRO 6000 Blackwell Server Edition" and g.pci_bus_id == "00000000:41:00.0"
    assert (g.pcie_gen, g.pcie_width, g.pcie_gen_max, g.pcie_width_max) == (1, 16, 5, 16)  # idle: gen 1
    assert g.compute_capability == (12, 0) and g.uuid.startswith("GPU-c72e9b04")
    old = topology.parse_gpu_query("0, Tesla V100-SXM2-16GB, 00000000:06:00.0, [N/A], 3, 16, 3, [Not Supported]\n",
                                   topology.QUERY_FIELDS_OLD)
    assert old[0].uuid is None and old[0].pcie_width_max is None and old[0].compute_capability is None
    with pytest.raises(ValueError):
        topology.parse_gpu_query("0, only, three\n")


# --------------------------------------------------------------------------------------------- Topology

@pytest.mark.parametrize("box", [PRO, RTX4090, H100])
def test_json_round_trip(box):
    topo = recorded(box)
    data = json.loads(json.dumps(topo.to_json()))  # plain dict, JSON-safe
    assert Topology.from_json(data) == topo


def test_json_round_trip_empty_and_partial():
    empty = Topology(notes=("nvidia-smi not found",))
    assert Topology.from_json(json.loads(json.dumps(empty.to_json()))) == empty
    partial = topology.topology_from_nvidia_smi(text(f"{H100}.topo.txt"), source="recorded")
    assert Topology.from_json(partial.to_json()) == partial


def test_topology_validates_shape_and_source():
    with pytest.raises(ValueError):
        Topology(gpus=(GpuInfo(0),), link=(), p2p=((True,),))
    with pytest.raises(ValueError):
        Topology(source="guess")


def test_recorded_box_details():
    topo = recorded(PRO)
    assert topo.source == "nvidia-smi" and topo.notes == ()
    assert [g.numa_node for g in topo.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.gpus[7].pci_bus_id == "00000000:E1:00.0"


def test_worst_link():
    topo = recorded(PRO)
    assert policy.worst_link(topo.link) is XS
    assert policy.worst_link(topo.link, (0, 1)) is SW
    assert policy.worst_link(topo.link, (0, 1, 2, 3)) is HB
    assert policy.worst_link(topo.link, (5,)) is UNK and policy.worst_link(Topology().link) is UNK
    assert policy.worst_link(recorded(H100).link) is NV


def test_summary_for_policy():
    assert policy.summarize(recorded(PRO).link, recorded(PRO).p2p) == (XS, True)
    assert policy.summarize(recorded(RTX4090).link, recorded(RTX4090).p2p) == (HB, False)
    assert policy.summarize(recorded(H100).link, recorded(H100).p2p) == (NV, True)
    no_p2p = topology.topology_from_nvidia_smi(text(f"{H100}.topo.txt"))
    assert policy.summarize(no_p2p.link, no_p2p.p2p) == (NV, None)
    assert policy.summarize((), ()) == (UNK, None)


# --------------------------------------------------------------------------------------------- islands

def matrix_topology(codes: list[str]) -> Topology:
    """A topology from rows of nvidia-smi codes ('X' on the diagonal)."""
    n = len(codes)
    link = tuple(tuple(topology.link_from_smi(c) for c in row.split()) for row in codes)
    return Topology(gpus=tuple(GpuInfo(i) for i in range(n)), link=link,
                    p2p=tuple(tuple(True for _ in range(n)) for _ in range(n)), source="recorded")


def test_islands_recorded_boxes():
    assert policy.islands(recorded(PRO).link) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert policy.islands(recorded(H100).link) == (tuple(range(8)),)
    assert policy.islands(recorded(RTX4090).link) == ((0, 1, 2, 3),)


def test_islands_of_subsets():
    topo = recorded(PRO)
    assert policy.islands(topo.link, (0, 1, 2, 3)) == ((0, 1), (2, 3))  # PIX pairs joined by the host bridge
    assert policy.islands(topo.link, (6, 4, 7, 5)) == ((4, 5), (6, 7))
    assert policy.islands(topo.link, (0, 1, 2, 4, 5, 6)) == ((0, 1, 2), (4, 5, 6))
    assert policy.islands(topo.link, (0, 1, 2, 3, 4, 5)) == ((0, 1, 2, 3, 4, 5),)  # 4 + 2: unequal
    assert policy.islands(topo.link, (0, 4)) == ((0, 4),)  # islands of one are pointless


def test_islands_are_valid_for_policy():
    isl = policy.islands(recorded(PRO).link)
    assert policy.validate_islands(isl, 8) == isl


def test_islands_need_fast_cliques():
    # 0-1 and 1-2 are fast but 0-2 is not: a chain, not an island.
    chain = matrix_topology(["X PIX SYS SYS", "PIX X PIX SYS", "SYS PIX X PIX", "SYS SYS PIX X"])
    assert policy.islands(chain.link) == ((0, 1, 2, 3),)
    unknown = matrix_topology(["X PIX ? ?", "PIX X ? ?", "? ? X PIX", "? ? PIX X"])
    assert policy.islands(unknown.link) == ((0, 1, 2, 3),)
    quads = matrix_topology(["X NV18 SYS SYS", "NV18 X SYS SYS", "SYS SYS X NV18", "SYS SYS NV18 X"])
    assert policy.islands(quads.link) == ((0, 1), (2, 3))


# --------------------------------------------------------------------------------------------- probe

def done(stdout: str, rc: int = 0) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], rc, stdout=stdout, stderr="")


def query_argv(fields=topology.QUERY_FIELDS) -> tuple[str, ...]:
    return ("nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader")


class Runner:
    """Stands in for subprocess.run: answers each nvidia-smi command line from a table."""

    def __init__(self, answers: dict):
        self.answers, self.calls = answers, []

    def __call__(self, argv, **kwargs):
        self.calls.append(tuple(argv))
        answer = self.answers.get(tuple(argv), FileNotFoundError(argv[0]))
        if isinstance(answer, BaseException):
            raise answer
        return answer


def box_runner(box: str, override: dict | None = None) -> Runner:
    answers = {("nvidia-smi", "topo", "-m"): done(text(f"{box}.topo.txt")),
               ("nvidia-smi", "topo", "-p2p", "w"): done(text(f"{box}.p2p.txt")),
               query_argv(): done(text(f"{box}.query.csv"))}
    answers.update(override or {})
    return Runner(answers)


def no_nvml():
    return None


def test_probe_nvidia_smi_fallback():
    run = box_runner(PRO)
    topo = topology.probe(run, env={}, nvml_loader=no_nvml, sysfs_pci="/nonexistent")
    assert topo.source == "nvidia-smi"
    assert len(topo.gpus) == 8 and topo.gpus[0].name.startswith("NVIDIA RTX PRO 6000")
    assert policy.islands(topo.link) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert policy.summarize(topo.link, topo.p2p) == (XS, True)
    assert any("pynvml" in n for n in topo.notes)
    assert all(kw_argv[0] == "nvidia-smi" for kw_argv in run.calls)


def test_probe_4090_box_without_p2p():
    topo = topology.probe(box_runner(RTX4090), env={}, nvml_loader=no_nvml)
    assert policy.summarize(topo.link, topo.p2p) == (HB, False)
    assert [g.pcie_gen for g in topo.gpus] == [1, 1, 1, 1] and [g.pcie_gen_max for g in topo.gpus] == [4] * 4


def test_probe_nvlink_box():
    topo = topology.probe(box_runner(H100), env={}, nvml_loader=no_nvml)
    assert policy.summarize(topo.link, topo.p2p) == (NV, True)
    assert policy.islands(topo.link) == (tuple(range(8)),)
    assert topo.gpus[3].compute_capability == (9, 0)


def test_probe_without_nvml_or_nvidia_smi():
    topo = topology.probe(Runner({}), env={}, nvml_loader=no_nvml)
    assert topo == Topology(source="none", notes=topo.notes)
    assert any("pynvml" in n for n in topo.notes) and any("nvidia-smi not found" in n for n in topo.notes)


@pytest.mark.parametrize("recording, rc, says", [("no_devices.txt", 6, "No devices were found"),
                                                 ("no_driver.txt", 9, "couldn't communicate")])
def test_probe_nvidia_smi_without_devices(recording, rc, says):
    answer = done(text(recording), rc)
    run = Runner({("nvidia-smi", "topo", "-m"): answer, query_argv(): answer})
    topo = topology.probe(run, env={"CUDA_VISIBLE_DEVICES": "0"}, nvml_loader=no_nvml)
    assert topo.gpus == () and topo.source == "none"
    assert any(says in n and f"exit {rc}" in n for n in topo.notes)


@pytest.mark.parametrize("failure", [subprocess.TimeoutExpired("nvidia-smi", 60), PermissionError("denied")])
def test_probe_survives_runner_errors(failure):
    topo = topology.probe(Runner({("nvidia-smi", "topo", "-m"): failure}), env={}, nvml_loader=no_nvml)
    assert topo.gpus == () and type(failure).__name__ in topo.notes[-1]


def test_probe_unparsable_output():
    topo = topology.probe(box_runner(PRO, {("nvidia-smi", "topo", "-m"): done("Segmentation fault\n")}),
                          env={}, nvml_loader=no_nvml)
    assert topo.gpus == () and "could not parse" in topo.notes[-1]


def test_probe_old_driver_without_compute_cap_or_p2p():
    old_csv = "".join(line.rsplit(",", 1)[0] + "\n" for line in text(f"{PRO}.query.csv").splitlines())
    run = box_runner(PRO, {query_argv(): done('Field "compute_cap" is not a valid field to query.\n', 2),
                             query_argv(topology.QUERY_FIELDS_OLD): done(old_csv),
                             ("nvidia-smi", "topo", "-p2p", "w"): done("Invalid combination of input arguments.\n", 2)})
    topo = topology.probe(run, env={}, nvml_loader=no_nvml)
    assert len(topo.gpus) == 8 and topo.gpus[0].compute_capability is None and topo.gpus[0].pcie_gen_max == 5
    assert set(off_diagonal(topo.p2p)) == {None}
    assert policy.summarize(topo.link, topo.p2p) == (XS, None)
    assert any("-p2p" in n for n in topo.notes) and any("compute capability" in n for n in topo.notes)


def test_probe_keeps_links_when_details_are_garbled():
    topo = topology.probe(box_runner(PRO, {query_argv(): done("0, half a line\n")}), env={}, nvml_loader=no_nvml)
    assert len(topo.gpus) == 8 and topo.gpus[0].name == "" and policy.islands(topo.link) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert any("--query-gpu output not understood" in n for n in topo.notes)
    topo = topology.probe(box_runner(PRO, {("nvidia-smi", "topo", "-p2p", "w"): done("GPU0 GPU1\n")}), env={},
                          nvml_loader=no_nvml)
    assert len(topo.gpus) == 8 and policy.summarize(topo.link, topo.p2p) == (XS, None)
    assert any("-p2p w output not understood" in n for n in topo.notes)
    four = text(f"{RTX4090}.p2p.txt")
    topo = topology.probe(box_runner(PRO, {("nvidia-smi", "topo", "-p2p", "w"): done(four)}), env={},
                          nvml_loader=no_nvml)
    assert set(off_diagonal(topo.p2p)) == {None} and any("P2P ignored" in n for n in topo.notes)


def test_probe_numa_from_sysfs_when_nvidia_smi_says_na(tmp_path):
    topo_text = text(f"{RTX4090}.topo.txt").replace("0               N/A", "N/A             N/A")
    (tmp_path / "0000:21:00.0").mkdir()
    (tmp_path / "0000:21:00.0" / "numa_node").write_text("1\n")
    (tmp_path / "0000:41:00.0").mkdir()
    (tmp_path / "0000:41:00.0" / "numa_node").write_text("-1\n")  # platform without NUMA info
    run = box_runner(RTX4090, {("nvidia-smi", "topo", "-m"): done(topo_text)})
    topo = topology.probe(run, env={}, nvml_loader=no_nvml, sysfs_pci=str(tmp_path))
    assert [g.numa_node for g in topo.gpus] == [None, 1, None, None]
    assert any("NUMA node unknown for GPU 0, 2, 3" in n for n in topo.notes)


# CUDA_VISIBLE_DEVICES -----------------------------------------------------------------------------------

def probe_visible(value: str, box: str = PRO, **env) -> Topology:
    return topology.probe(box_runner(box), env={"CUDA_VISIBLE_DEVICES": value, **env}, nvml_loader=no_nvml)


def test_visible_devices_subset_in_order():
    topo = probe_visible("4,5,6,7")
    assert [g.index for g in topo.gpus] == [4, 5, 6, 7]
    assert policy.worst_link(topo.link) is HB and policy.islands(topo.link) == ((0, 1), (2, 3))
    assert any("ranks are GPU 4, 5, 6, 7" in n for n in topo.notes)
    topo = probe_visible("6,1")
    assert [g.index for g in topo.gpus] == [6, 1] and topo.link[0][1] is XS


def test_visible_devices_like_cuda():
    assert [g.index for g in probe_visible("0,1,99,2").gpus] == [0, 1]  # stops at the first invalid entry
    assert [g.index for g in probe_visible("2,2,3").gpus] == [2]        # a duplicate is invalid too
    assert probe_visible("").gpus == () and probe_visible("-1").gpus == ()
    assert probe_visible("0,1,2,3,4,5,6,7").notes == probe_visible("0,1,2,3,4,5,6,7,").notes


def test_visible_devices_by_uuid():
    topo = probe_visible("GPU-e0b7f419,GPU-71c5a3d8-0e9b-4f62-a4d7-c8b1e5f29036")
    assert [g.index for g in topo.gpus] == [6, 7]
    for unmappable in ("GPU-deadbeef", "GPU-", "MIG-5c1f0e8a-2d7b-4f93-b6a0-e81c4d92f375"):
        topo = probe_visible(unmappable)
        assert len(topo.gpus) == 8 and any("could not be mapped" in n for n in topo.notes)


def test_visible_devices_mixed_models_noted():
    csv = text(f"{RTX4090}.query.csv").replace("RTX 4090, 00000000:61", "RTX 3090, 00000000:61")
    run = box_runner(RTX4090, {query_argv(): done(csv)})
    topo = topology.probe(run, env={"CUDA_VISIBLE_DEVICES": "3,0"}, nvml_loader=no_nvml)
    assert any("CUDA_DEVICE_ORDER" in n for n in topo.notes)
    env = {"CUDA_VISIBLE_DEVICES": "3,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert not any("CUDA_DEVICE_ORDER" in n for n in topology.probe(run, env=env, nvml_loader=no_nvml).notes)


# NVML ---------------------------------------------------------------------------------------------------

class FakeNvmlError(Exception):
    pass


class FakeNvml:
    """The slice of pynvml that probe() calls, answering for a given common-ancestor level matrix."""

    NVML_NVLINK_MAX_LINKS = 18

    def __init__(self, levels, *, bus_ids, nvlink=False, p2p_write=0, pcie=True, init_error=None, numa_masks=None):
        self.levels, self.bus_ids, self.nvlink, self.p2p_write = levels, bus_ids, nvlink, p2p_write
        self.pcie, self.init_error, self.shut_down = pcie, init_error, False
        self.numa_masks = numa_masks or {}

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlDeviceGetCount(self):
        return len(self.levels)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.bus_ids[h].encode())  # ctypes char arrays come back as bytes

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA RTX PRO 6000 Blackwell Server Edition"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h:08x}-0000-0000-0000-000000000000"

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (12, 0)

    def _pcie(self, value):
        if not self.pcie:
            raise FakeNvmlError("Not Supported")
        return value

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self._pcie(1)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._pcie(5)

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._pcie(16)

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._pcie(16)

    def nvmlDeviceGetMemoryAffinity(self, h, words, scope):
        assert scope == 0  # NVML_AFFINITY_SCOPE_NODE
        if h not in self.numa_masks:
            raise FakeNvmlError("Not Supported")
        return (self.numa_masks[h] + [0] * words)[:words]

    def nvmlDeviceGetNvLinkState(self, h, link):
        if not self.nvlink:
            raise FakeNvmlError("Not Supported")
        return 1

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.levels[a][b]

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        if index == 2:  # NVML_P2P_CAPS_INDEX_NVLINK
            return 0 if self.nvlink else 3
        assert index == 1  # only the write capability is asked for
        if self.p2p_write is None:
            raise FakeNvmlError("Unknown Error")
        return self.p2p_write


def pcie_box_levels():
    """8 GPUs: pairs on one switch (SINGLE), switches of a socket meet at NODE, sockets at SYSTEM."""
    return [[0 if i == j else 10 if i // 2 == j // 2 else 40 if i // 4 == j // 4 else 50 for j in range(8)]
            for i in range(8)]


def sysfs(tmp_path, bus_ids, nodes):
    for bus, node in zip(bus_ids, nodes):
        d = tmp_path / f"0000:{bus.split(':')[1].lower()}:00.0"
        d.mkdir()
        (d / "numa_node").write_text(f"{node}\n")
    return str(tmp_path)


BUS = [f"00000000:{b}:00.0" for b in ("01", "21", "41", "61", "81", "A1", "C1", "E1")]


def test_probe_nvml(tmp_path):
    nvml = FakeNvml(pcie_box_levels(), bus_ids=BUS)
    run = Runner({})
    topo = topology.probe(run, env={}, nvml_loader=lambda: nvml, sysfs_pci=sysfs(tmp_path, BUS, [0] * 4 + [1] * 4))
    assert run.calls == [] and nvml.shut_down
    assert topo.source == "nvml" and topo.notes == ()
    assert topo == recorded_like_nvml()


def recorded_like_nvml() -> Topology:
    """What NVML's answers above should amount to: the recorded PRO box, read another way."""
    smi = recorded(PRO)
    gpus = tuple(GpuInfo(index=g.index, name=g.name, pci_bus_id=g.pci_bus_id,
                         uuid=f"GPU-{g.index:08x}-0000-0000-0000-000000000000", numa_node=g.numa_node,
                         pcie_gen=1, pcie_width=16, pcie_gen_max=5, pcie_width_max=16, compute_capability=(12, 0))
                 for g in smi.gpus)
    return Topology(gpus=gpus, link=smi.link, p2p=smi.p2p, source="nvml")


def test_probe_nvml_nvlink_and_missing_reads(tmp_path):
    levels = [[0, 50], [50, 0]]
    nvml = FakeNvml(levels, bus_ids=BUS[:2], nvlink=True, p2p_write=None, pcie=False)
    topo = topology.probe(Runner({}), env={}, nvml_loader=lambda: nvml, sysfs_pci=sysfs(tmp_path, BUS[:2], [0, -1]))
    assert topo.link[0][1] is NV and topo.p2p[0][1] is None
    assert [g.numa_node for g in topo.gpus] == [0, None]
    assert any("P2P write status" in n for n in topo.notes)
    assert any("current PCIe link not readable for GPU 0, 1" in n for n in topo.notes)
    assert any("NUMA node unknown for GPU 1" in n for n in topo.notes)


def test_probe_nvml_numa_when_sysfs_has_none(tmp_path):
    # VMs leave sysfs numa_node at -1; NVML's memory affinity still names one node (or several: no answer).
    nvml = FakeNvml([[0, 40, 40], [40, 0, 40], [40, 40, 0]], bus_ids=BUS[:3], numa_masks={0: [0b10], 1: [0b11]})
    topo = topology.probe(Runner({}), env={}, nvml_loader=lambda: nvml, sysfs_pci=sysfs(tmp_path, BUS[:3], [-1] * 3))
    assert [g.numa_node for g in topo.gpus] == [1, None, None]
    nvml = FakeNvml([[0, 40], [40, 0]], bus_ids=BUS[:2], numa_masks={0: [0, 1]})  # node 64: second word
    topo = topology.probe(Runner({}), env={}, nvml_loader=lambda: nvml, sysfs_pci=str(tmp_path / "none"))
    assert [g.numa_node for g in topo.gpus] == [64, None]


def test_probe_nvml_consumer_gpus_without_p2p(tmp_path):
    nvml = FakeNvml([[0, 30], [30, 0]], bus_ids=BUS[:2], p2p_write=3)  # 3: NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED
    topo = topology.probe(Runner({}), env={}, nvml_loader=lambda: nvml, sysfs_pci=str(tmp_path))
    assert policy.summarize(topo.link, topo.p2p) == (HB, False)


def test_probe_nvml_unusable_falls_back_to_nvidia_smi():
    broken = FakeNvml(pcie_box_levels(), bus_ids=BUS, init_error=FakeNvmlError("NVML Shared Library Not Found"))
    topo = topology.probe(box_runner(PRO), env={}, nvml_loader=lambda: broken)
    assert topo.source == "nvidia-smi" and len(topo.gpus) == 8
    assert "NVML Shared Library Not Found" in topo.notes[0]

    def bad_import():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")
    topo = topology.probe(box_runner(PRO), env={}, nvml_loader=bad_import)
    assert topo.source == "nvidia-smi" and "cannot open shared object" in topo.notes[0]

    midway = FakeNvml(pcie_box_levels(), bus_ids=BUS[:3])  # 8 GPUs counted, 3 bus ids: fails mid-way
    topo = topology.probe(Runner({}), env={}, nvml_loader=lambda: midway)
    assert topo.gpus == () and midway.shut_down and any("reading the topology failed" in n for n in topo.notes)


def test_probe_nvml_respects_visible_devices(tmp_path):
    nvml = FakeNvml(pcie_box_levels(), bus_ids=BUS)
    topo = topology.probe(Runner({}), env={"CUDA_VISIBLE_DEVICES": "GPU-00000005,4"}, nvml_loader=lambda: nvml,
                          sysfs_pci=str(tmp_path))
    assert [g.index for g in topo.gpus] == [5, 4] and topo.link[0][1] is SW


# --------------------------------------------------------------------------------------------- CLI

@pytest.fixture
def cli(monkeypatch, capsys):
    for var in VARIABLES:
        monkeypatch.delenv(var.name, raising=False)

    def call(*argv):
        parser = argparse.ArgumentParser(prog="fastcomm")
        topo_cli.add_parser(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["topo", *argv])
        rc = args.func(args)
        out, err = capsys.readouterr()
        return rc, out, err
    return call


def test_cli_human(cli):
    rc, out, _ = cli("--from-file", str(DATA / f"{PRO}.topo.txt"), "--p2p-file", str(DATA / f"{PRO}.p2p.txt"))
    assert rc == 0
    assert "fastcomm topology: 8 GPUs (source: recorded)" in out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("link "))
    assert lines[head + 1].split()[:9] == ["0", "X", "PIX", "PHB", "PHB", "SYS", "SYS", "SYS", "SYS"]
    assert lines[head + 1].split()[9] == "0" and lines[head + 8].split()[9] == "1"  # NUMA column
    assert any(line.startswith("p2p w") for line in lines)
    assert "islands: [0 1 2 3] [4 5 6 7]  (hierarchical" in out
    assert "plan: transport p2p, link cross_socket, world size 8" in out
    rules = policy.DEFAULT_TABLE[policy.PolicyKey(policy.Transport.P2P, XS, 0)]
    bound = policy.plan.scale_one_shot(rules, 4)[0].max_bytes  # islands 4+4: 3 island peers + 1 partner
    assert f"<= {bound // 1024} KiB: one_shot" in out and "nccl (not fastcomm)" in out
    assert "query-gpu" in out  # says what it could not read


def test_cli_json(cli):
    rc, out, _ = cli("--json", "--from-file", str(DATA / f"{RTX4090}.topo.txt"),
                     "--p2p-file", str(DATA / f"{RTX4090}.p2p.txt"))
    assert rc == 0
    data = json.loads(out)
    assert Topology.from_json(data["topology"]).link == recorded(RTX4090).link
    assert data["worst_link"] == "host_bridge" and data["all_p2p"] is False and data["islands"] == [[0, 1, 2, 3]]
    plan = data["plan"]
    assert (plan["transport"], plan["link"], plan["world_size"]) == ("host", "host_bridge", 4)
    rules = policy.lookup_rules(policy.DEFAULT_TABLE, policy.Transport.HOST, UNK, 4)
    assert [r["algo"] for r in plan["ranges"]] == [r.algo.value for r in rules] + ["nccl"]
    assert plan["ranges"][0]["min_bytes"] == 1 and plan["ranges"][-1]["max_bytes"] is None


def test_cli_reads_its_own_json(cli, tmp_path):
    _, out, _ = cli("--json", "--from-file", str(DATA / f"{H100}.topo.txt"),
                    "--p2p-file", str(DATA / f"{H100}.p2p.txt"))
    dump = tmp_path / "topo.json"
    dump.write_text(out)
    rc, again, _ = cli("--json", "--from-file", str(dump))
    assert rc == 0 and json.loads(again) == json.loads(out)
    assert json.loads(out)["plan"]["link"] == "nvlink"


def test_cli_probes_when_no_file(cli, monkeypatch):
    empty = Topology(notes=("nvidia-smi not found (no NVIDIA driver installed?)",))
    monkeypatch.setattr(topology, "probe", lambda: empty)
    rc, out, _ = cli()
    assert rc == 0 and "0 GPUs (source: none)" in out and "nvidia-smi not found" in out
    assert "nothing to do on 0 GPUs" in out


def test_cli_follows_configuration(cli, monkeypatch):
    monkeypatch.setenv("FASTCOMM_TRANSPORT", "host")
    monkeypatch.setenv("FASTCOMM_MAX_BYTES", str(1 << 20))
    rc, out, _ = cli("--json", "--from-file", str(DATA / f"{PRO}.topo.txt"), "--p2p-file", str(DATA / f"{PRO}.p2p.txt"))
    plan = json.loads(out)["plan"]
    assert plan["transport"] == "host" and plan["islands"] is None  # the host transport is flat
    assert plan["ranges"][-1] == {"min_bytes": (1 << 20) + 1, "max_bytes": None, "algo": "nccl"}


def test_cli_shows_no_plan_the_workspace_would_refuse(cli, monkeypatch):
    # Islands with the host transport: a workspace refuses that, so topo proposes no plan and says why.
    monkeypatch.setenv("FASTCOMM_TRANSPORT", "host")
    monkeypatch.setenv("FASTCOMM_ISLANDS", "0,1,2,3;4,5,6,7")
    rc, out, _ = cli("--json", "--from-file", str(DATA / f"{PRO}.topo.txt"), "--p2p-file", str(DATA / f"{PRO}.p2p.txt"))
    data = json.loads(out)
    assert rc == 0 and data["plan"] is None and "needs P2P" in data["no_plan"]
    assert data["forced_islands"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_cli_errors(cli, tmp_path):
    rc, _, err = cli("--from-file", str(tmp_path / "missing.txt"))
    assert rc == 2 and "fastcomm topo:" in err
    (tmp_path / "garbage.txt").write_text("No devices were found\n")
    rc, _, err = cli("--from-file", str(tmp_path / "garbage.txt"))
    assert rc == 2 and "GPU0" in err


@pytest.mark.parametrize("forced", ["auto", "one_shot", "two_shot"])
@pytest.mark.parametrize("key", list(policy.DEFAULT_TABLE))
def test_size_ranges_match_choose_algo(key, forced):
    rules = policy.DEFAULT_TABLE[key]
    cfg = Config(max_bytes=8 << 20, one_shot_max_bytes=1 << 20)
    ranges = policy.size_ranges(rules, one_shot_max_bytes=cfg.one_shot_max_bytes, max_bytes=cfg.max_bytes,
                                  forced=forced)
    assert ranges[0].min_bytes == 1 and ranges[-1].max_bytes is None
    assert all(a.max_bytes + 1 == b.min_bytes and a.algo is not b.algo for a, b in zip(ranges, ranges[1:]))
    probes = {1, 1 << 40} | {b + d for r in ranges if r.max_bytes for b in (r.max_bytes,) for d in (-1, 0, 1)}
    for size in sorted(probes):
        want = policy.choose_algo(size, rules, one_shot_max_bytes=cfg.one_shot_max_bytes, max_bytes=cfg.max_bytes,
                                  forced=forced)
        got = next(r.algo for r in ranges if r.min_bytes <= size and (r.max_bytes is None or size <= r.max_bytes))
        assert got is want, size


def test_modules_do_not_import_torch():
    # The package __init__ may pull in torch for the ops; the probe and its CLI must not need it. Load the
    # package directory without running __init__ to check these modules alone.
    code = ("import sys, types; pkg = types.ModuleType('fastcomm'); pkg.__path__ = [sys.argv[1]]; "
            "sys.modules['fastcomm'] = pkg; import fastcomm.topology, fastcomm.commands.topo; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code, str(Path(topology.__file__).parent)], check=True)
