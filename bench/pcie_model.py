"""A model, from measured per-call constants, of fastcomm's all-reduce on 8 GPUs over PCIe Gen5.

    python -m fastcomm_bench.pcie_model [--results DIR] [--sizes 4K,12K,...] [--json PATH]

It is a model, labelled as one on every row. Its inputs, each printed with where it comes from:
- measured on 2 x H200 (the committed ``fastcomm bench`` files of 2026-11-30 in bench/results/), graph mode:
  least squares lines of time against the bytes each GPU wrote with that run's code (intercept: the per-call
  constant; slope: 1 / bandwidth) for the one-shot's and the two-shot's floors over NVLink and the host
  transport's floor and per-byte cost (it crosses real PCIe Gen5 to host memory); differences of rows for a
  kernel node in a graph, the islands' second launch, and an all-reduce right after a GEMM over back-to-back.
  Those runs predate issue 15's kernels: the current kernels are given the same floors (unmeasured so far);
- assumptions where nothing was measured (issue 15's figures): ~50 GB/s per direction per x16 link, ~24 GB/s
  per GPU across the two sockets, ~1 us per PCIe write crossing, 0.3 us per dependent re-poll from L2, the
  old two-shot's ~22 dependent latencies per thread at 8 ranks (~4 at 2); the brief's NCCL (~40 us per call,
  30-135 us) and its 23.3 ms decode step of 157 all-reduces;
- bytes on the wire per GPU from the library (``fastcomm.policy.wire_bytes``, the bench's ``wire B/GPU``
  column; ``ll_bytes`` for the old one-shot's 16-byte flag-in-data packets).

Per call: floor + one PCIe write crossing per dependent hop + dependent waits + bytes / bandwidth (the two
sockets: the larger of the link's and the socket link's share; islands: inside, then across). Not modelled:
system-scope fence costs, host-memory bandwidth shared by 8 readers, PCIe switch contention, NCCL's protocols
(its time is the brief's at 12 KB plus its ring's further bytes at the link rate).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Sequence

from fastcomm.policy import ll_bytes, nccl_ring_bytes, wire_bytes, wire_cross
from fastcomm.units import KiB, format_size, parse_size

# The brief's decode workload (GLM-5 on 8 x RTX PRO 6000): the all-reduce model's inputs, and predict_mtp's.
HIDDEN = 6144
LAYERS = 78                        # GLM-5's decoder layers
ALLREDUCES_PER_STEP = 2 * LAYERS + 1   # 2 per layer + the embedding: 157
BRIEF_STEP_MS, BRIEF_AR_US = 23.3, 40.0   # 43 tok/s with CUDA graphs through NCCL at ~40 us per all-reduce

RESULTS = Path(__file__).resolve().parent / "results"
RUN5_P2P = "2026-11-30-h200x2-run5-p2p.json"      # NVLink P2P rows, islands, fused (40 replays)
RUN5_HOST = "2026-11-30-h200x2-run5-nop2p.json"   # host transport vs NCCL_P2P_DISABLE=1 (40 replays)
RUN9_GEMM = "2026-11-30-h200x2-run9-interleave.json"  # the same calls right after a GEMM
FLOOR_SIZES = (1 * KiB, 16 * KiB)     # the per-call constant: the smallest rows, where bytes barely count
SLOPE_SIZES = (16 * KiB, 256 * KiB)   # the per-byte cost: rows where bytes dominate, below 1 MB's jitter
WORLD, SOCKETS = 8, 2
DECODE_BYTES = HIDDEN * 2             # one token of bf16: 12 KB
SIZES = (4 * KiB, DECODE_BYTES, 64 * KiB, 256 * KiB, 1024 * KiB)


@dataclasses.dataclass(frozen=True)
class Const:
    name: str
    value: float
    unit: str
    source: str      # file and rows, or "assumption: ..." with where the figure is from


# Assumptions: no measurement of these exists in bench/results (no PCIe P2P GPUs were lent).
LINK_GBPS = Const("link_gbps", 50.0, "GB/s", "assumption (issue 15): PCIe Gen5 x16, per direction")
SOCKET_GBPS = Const("socket_gbps", 24.0, "GB/s", "assumption (issue 15): per GPU between the two sockets")
CROSSING_US = Const("crossing_us", 1.0, "us", "assumption (issue 15): a PCIe write crossing, added to each "
                    "dependent hop on top of the NVLink floor (conservative: NVLink's own latency stays in)")
L2_POLL_US = Const("l2_poll_us", 0.3, "us", "assumption (issue 15): a dependent re-poll from L2 (P2P)")
OLD_TWO_SHOT_LATENCIES = Const("old_two_shot_latencies", 22 - 4, "loads", "assumption (issue 15, read from "
                               "the code): the old two-shot's dependent latencies per thread, 22 at 8 ranks "
                               "minus the 4 at 2 already in the measured floor")
NCCL_US = Const("nccl_us", BRIEF_AR_US, "us", "the brief: NCCL per all-reduce in the 8 x RTX PRO 6000 decode "
                "step (30-135 us seen); its protocol (LL or not) is not modelled")
NCCL_RANGE_US = (30.0, 135.0)
ASSUMPTIONS = (LINK_GBPS, SOCKET_GBPS, CROSSING_US, L2_POLL_US, OLD_TWO_SHOT_LATENCIES, NCCL_US)


@dataclasses.dataclass(frozen=True)
class Line:
    intercept: float   # us
    slope: float       # us per byte
    points: int


def fit_line(points: Sequence[tuple[float, float]]) -> Line:
    """Least squares y = intercept + slope x (the floors: time in us against bytes)."""
    if len({x for x, _ in points}) < 2:
        raise ValueError("a line needs rows at two or more sizes")
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return Line(my - slope * mx, slope, n)


def graph_rows(record: dict, impl: str) -> dict[int, float]:
    """size -> graph-mode us of one implementation's rows in a ``fastcomm bench`` record."""
    rows = {r["size"]: r["graph_us"] for r in record["rows"] if r["impl"] == impl and r.get("graph_us") is not None}
    if not rows:
        raise ValueError(f"no rows of {impl!r}")
    return rows


def _within(rows: dict[int, float], window: tuple[int, int]) -> list[int]:
    return [s for s in sorted(rows) if window[0] <= s <= window[1]]


def _line(record: dict, impl: str, window: tuple[int, int], wire) -> Line:
    rows = graph_rows(record, impl)
    return fit_line([(wire(s), rows[s]) for s in _within(rows, window)])


def _at(record: dict, impl: str, size: int) -> float:
    rows = graph_rows(record, impl)
    if size not in rows:
        raise ValueError(f"no {impl!r} row at {size} bytes")
    return rows[size]


def _rows_label(file: str, impl: str, window: tuple[int, int]) -> str:
    return f"{file} {impl} {format_size(window[0], True)}-{format_size(window[1], True)}"


@dataclasses.dataclass(frozen=True)
class Measured:
    one_shot_floor: Const    # P2P one-shot over NVLink: graph node + one crossing
    two_shot_floor: Const    # P2P two-shot over NVLink: graph node + two phases with flags
    host_floor: Const        # host one-shot: node + a PCIe write to host memory + polling it there
    host_us_per_byte: Const  # host one-shot, per byte each GPU moves each way (real PCIe Gen5)
    node: Const              # one more kernel node in a graph (the norm after the all-reduce)
    second_launch: Const     # the two-launch islands over the one-shot
    after_gemm: Const        # an all-reduce right after the GEMM writing its input, over back-to-back
    nccl_p2p_floor: Const    # context only: 2-rank NCCL floors (the 8-GPU NCCL figure is the brief's)
    nccl_host_floor: Const

    @property
    def host_round_trip(self) -> Const:
        """What a host-memory hop adds over an NVLink one (the floors' difference): one round trip."""
        return Const("host_round_trip_us", self.host_floor.value - self.one_shot_floor.value, "us",
                     "host_floor - one_shot_floor")

    def constants(self) -> list[Const]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)] + [self.host_round_trip]


def measure(results: Path = RESULTS) -> Measured:
    """The measured constants, fitted from the committed result files (run 5 ran the flag-in-data one-shot:
    each GPU wrote ``ll_bytes`` per peer; at 2 ranks one peer)."""
    def load(name):
        try:
            return json.loads((Path(results) / name).read_text())
        except OSError as e:
            raise ValueError(f"cannot read {Path(results) / name}: {e.strerror}") from None

    p2p, host, gemm = load(RUN5_P2P), load(RUN5_HOST), load(RUN9_GEMM)
    one = _line(p2p, "fastcomm-one_shot", FLOOR_SIZES, ll_bytes)
    two = _line(p2p, "fastcomm-two_shot", FLOOR_SIZES, lambda s: wire_bytes("two_shot", s, 2, "p2p"))
    host_floor = _line(host, "fastcomm-host-one_shot", FLOOR_SIZES, ll_bytes)
    host_bytes = _line(host, "fastcomm-host-one_shot", SLOPE_SIZES, ll_bytes)
    ring = lambda s: nccl_ring_bytes(s, 2)
    nccl_p2p = _line(p2p, "nccl", FLOOR_SIZES, ring)
    nccl_host = _line(host, "nccl", FLOOR_SIZES, ring)
    islands = graph_rows(p2p, "fastcomm-islands-one_shot")
    plain = graph_rows(p2p, "fastcomm-one_shot")
    window = (1 * KiB, 256 * KiB)
    second = statistics.median(islands[s] - plain[s] for s in _within(islands, window) if s in plain)
    norm = f"allreduce+norm 1x{HIDDEN}"
    node = _at(p2p, norm, DECODE_BYTES) - _at(p2p, "fastcomm-auto", DECODE_BYTES)
    after = _at(gemm, f"fastcomm-one_shot 1x{HIDDEN}", DECODE_BYTES) - _at(gemm, "fastcomm-one_shot", DECODE_BYTES)
    fit = "intercept of the least squares line over the rows"
    return Measured(
        one_shot_floor=Const("one_shot_floor_us", one.intercept, "us",
                             f"{_rows_label(RUN5_P2P, 'fastcomm-one_shot', FLOOR_SIZES)}: {fit}"),
        two_shot_floor=Const("two_shot_floor_us", two.intercept, "us",
                             f"{_rows_label(RUN5_P2P, 'fastcomm-two_shot', FLOOR_SIZES)}: {fit}"),
        host_floor=Const("host_floor_us", host_floor.intercept, "us",
                         f"{_rows_label(RUN5_HOST, 'fastcomm-host-one_shot', FLOOR_SIZES)}: {fit}"),
        host_us_per_byte=Const("host_us_per_byte", host_bytes.slope, "us/B",
                               f"{_rows_label(RUN5_HOST, 'fastcomm-host-one_shot', SLOPE_SIZES)}: slope against "
                               f"the packet bytes each GPU wrote (= read back), i.e. "
                               f"{1e-3 / host_bytes.slope:.1f} GB/s per direction"),
        node=Const("node_us", node, "us", f"{RUN5_P2P} '{norm}' - 'fastcomm-auto' at 12K"),
        second_launch=Const("second_launch_us", second, "us",
                            f"{RUN5_P2P} 'fastcomm-islands-one_shot' - 'fastcomm-one_shot', median over 1K-256K"),
        after_gemm=Const("after_gemm_us", after, "us",
                         f"{RUN9_GEMM} 'fastcomm-one_shot 1x{HIDDEN}' - 'fastcomm-one_shot' at 12K"),
        nccl_p2p_floor=Const("nccl_nvlink_floor_us", nccl_p2p.intercept, "us",
                             f"{_rows_label(RUN5_P2P, 'nccl', FLOOR_SIZES)}: {fit} (context, 2 ranks)"),
        nccl_host_floor=Const("nccl_no_p2p_floor_us", nccl_host.intercept, "us",
                              f"{_rows_label(RUN5_HOST, 'nccl', FLOOR_SIZES)}: {fit} (context, 2 ranks)"))


# ---- the model ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Box:
    """The modelled machine: 8 GPUs on one PCIe switch (islands 1) or on two sockets (islands 2)."""
    name: str
    transport: str = "p2p"
    islands: int = 1
    world: int = WORLD


ONE_SWITCH = Box("8 x PCIe Gen5, one switch")
TWO_SOCKETS = Box("8 x PCIe Gen5, 2 sockets x 4", islands=SOCKETS)
HOST = Box("8 x PCIe Gen5, host transport", transport="host")
BOXES = (ONE_SWITCH, TWO_SOCKETS, HOST)

# What the model knows per box. "-old": the code before issue 15's changes, as the issue reads it.
ALGOS = {"p2p": ("one_shot-old", "one_shot", "two_shot-old", "two_shot", "two_shot_ll"),
         "host": ("one_shot-old", "one_shot")}
# Two launches of the old one-shot; one launch of the current; the island two-shot (two_shot_islands.cuh).
ISLAND_ALGOS = ("islands-old", "islands", "two_shot_islands")


@dataclasses.dataclass(frozen=True)
class Prediction:
    algo: str
    nbytes: int
    wire: int        # bytes each GPU sends over its link (the library's count: the bench's wire B/GPU)
    cross: int       # of those, bytes across the socket boundary
    inbound: int     # host transport: bytes each GPU reads back from host memory (not in ``wire``)
    parts: dict      # us per term; us = their sum

    @property
    def us(self) -> float:
        return sum(self.parts.values())


def _copy(nbytes: int, old: bool) -> int:
    """One peer's copy of the one-shot: old flag-in-data packets, or the current payload-only slots."""
    return ll_bytes(nbytes) if old else wire_bytes("one_shot", nbytes, 2, "p2p")


def predict(algo: str, nbytes: int, box: Box, m: Measured) -> Prediction:
    """Modelled us per call of ``algo`` on ``box``, as named terms that add up:
    floor: the measured 2-rank floor of the same kernel shape (graph node + one hop over NVLink; the two-shot:
    two phases with flags; host: node + a hop through host memory); crossings: one PCIe write crossing per
    dependent hop; second hop: a further hop inside the same kernel, priced as the one-shot's floor less a
    graph node; waits: dependent re-polls (the old code waited on peers one by one; the old two-shot's table
    loads); second launch: the two-launch islands' measured extra; bytes: the busiest link's bytes over its
    bandwidth (host: what each GPU reads back, at the measured host rate)."""
    w, x = box.world, CROSSING_US.value
    per_us = 1e-3 / LINK_GBPS.value   # us per byte
    socket_us = 1e-3 / SOCKET_GBPS.value
    old = algo.endswith("-old")
    if box.transport == "host":
        if algo not in ALGOS["host"]:
            raise ValueError(f"no host model for {algo!r}")
        written = _copy(nbytes, old)  # the host one-shot writes one copy, into my own slot
        inbound = (w - 1) * written   # every reader pulls each peer's slot in over its own link (wire.py)
        waits = (w - 2) * m.host_round_trip.value if old else 0.0
        return Prediction(algo, nbytes, written, 0, inbound,
                          {"floor": m.host_floor.value, "waits": waits,
                           "bytes": inbound * m.host_us_per_byte.value})
    if algo in ISLAND_ALGOS and box.islands < 2:
        raise ValueError("islands need a box of two or more islands")
    if algo == "two_shot_islands":
        # Three flagged phases (reduce-scatter inside, across to the partners, all-gather inside): the
        # measured two-shot's two plus one more priced as one of them; the inside bytes at the link's rate,
        # the partials across at the socket link's.
        total = wire_bytes(algo, nbytes, w, "p2p", box.islands)
        cross = wire_cross(algo, nbytes, w, box.islands)
        parts = {"floor": m.two_shot_floor.value, "crossings": 3 * x,
                 "third phase": (m.two_shot_floor.value - m.node.value) / 2,
                 "bytes": (total - cross) * per_us + cross * socket_us}
        return Prediction(algo, nbytes, total, cross, 0, parts)
    if algo in ISLAND_ALGOS:
        size = w // box.islands
        copy = _copy(nbytes, old)
        inside = copy * (size - 1)                       # to my island peers
        total = copy * (size - 1 + box.islands - 1)      # and one to each other island's partner
        cross = total - inside
        parts = {"floor": m.one_shot_floor.value, "crossings": 2 * x,
                 "second hop": m.one_shot_floor.value - m.node.value,
                 "waits": (size - 2) * L2_POLL_US.value if old else 0.0,
                 "bytes": inside * per_us + cross * socket_us}
        if old:
            parts["second launch"] = m.second_launch.value
        return Prediction(algo, nbytes, total, cross, 0, parts)
    base = algo.removesuffix("-old")
    if algo not in ALGOS["p2p"]:
        raise ValueError(f"no P2P model for {algo!r}")
    total = (w - 1) * ll_bytes(nbytes) if algo == "one_shot-old" else wire_bytes(base, nbytes, w, "p2p")
    # Flat on two sockets: each GPU's traffic is spread evenly over its peers, w/2 of them across.
    cross = total * (w // 2) // (w - 1) if box.islands > 1 else 0
    bytes_us = max(total * per_us, cross * socket_us)
    if base == "one_shot":
        parts = {"floor": m.one_shot_floor.value, "crossings": x,
                 "waits": (w - 2) * L2_POLL_US.value if old else 0.0, "bytes": bytes_us}
    elif base == "two_shot":
        parts = {"floor": m.two_shot_floor.value, "crossings": 2 * x,
                 "waits": OLD_TWO_SHOT_LATENCIES.value * L2_POLL_US.value if old else 0.0, "bytes": bytes_us}
    else:  # two_shot_ll: two dependent hops in one kernel, readiness in the data (no flag round trip)
        parts = {"floor": m.one_shot_floor.value, "crossings": 2 * x,
                 "second hop": m.one_shot_floor.value - m.node.value, "bytes": bytes_us}
    return Prediction(algo, nbytes, total, cross, 0, parts)


def algos_for(box: Box) -> tuple[str, ...]:
    return ALGOS[box.transport] + (ISLAND_ALGOS if box.islands > 1 else ())


def step_ms(in_step_us: float) -> float:
    """The brief's decode step with every all-reduce at ``in_step_us`` instead of NCCL's."""
    return BRIEF_STEP_MS - ALLREDUCES_PER_STEP * (NCCL_US.value - in_step_us) / 1e3


def _swap(p: Prediction, **terms: float) -> Prediction:
    """``p`` with some of its terms replaced: one change applied, the others not yet."""
    return dataclasses.replace(p, parts={**p.parts, **terms})


def saves(box: Box, m: Measured, nbytes: int = DECODE_BYTES) -> list[dict]:
    """NCCL, then each change of issue 15 applied in turn on ``box``: us per all-reduce in a decode step
    (model + the measured after-GEMM cost; NCCL's figure is already in-step), what the change saves, and the
    step and tok/s after it. The rows' savings add up to NCCL's time minus the last row's."""
    def at(algo):
        return predict(algo, nbytes, box, m)

    if box.islands > 1:
        # The probe proposes the two sockets' islands and the plan takes them: the old code ran two launches.
        old, new = at("islands-old"), at("islands")
        halved = _swap(old, bytes=new.parts["bytes"])
        chain = [("old islands (two launches of the old one-shot; the probe's choice)", old),
                 ("payload-only Lamport slots", halved),
                 ("every source polled each round", _swap(halved, waits=0.0)),
                 ("islands in one launch", new)]
    else:
        old, new = at("one_shot-old"), at("one_shot")
        chain = [(f"old {'host ' if box.transport == 'host' else ''}one-shot (a flag in every 16 B packet, "
                  "peers waited on one by one)", old),
                 ("payload-only Lamport slots", _swap(old, bytes=new.parts["bytes"])),
                 ("every source polled each round", new)]
    if box.transport == "p2p":
        fastest = min((at(a) for a in algos_for(box) if not a.endswith("-old")), key=lambda p: p.us)
        chain.append((f"the fastest current kernel at this size: {fastest.algo}", fastest))
    rows = [{"change": "NCCL (the brief)", "us": NCCL_US.value}]
    rows += [{"change": c, "us": p.us + m.after_gemm.value} for c, p in chain]
    prev = None
    for r in rows:
        r["saves_us"] = 0.0 if prev is None else prev - r["us"]
        r["saves_ms_per_step"] = r["saves_us"] * ALLREDUCES_PER_STEP / 1e3
        r["step_ms"] = step_ms(r["us"])
        r["tok_s"] = 1e3 / r["step_ms"]
        r["label"] = "model"
        prev = r["us"]
    return rows


# ---- output ---------------------------------------------------------------------------------------------------

def nccl_us(nbytes: int, world: int = WORLD) -> float:
    """The brief's figure at a decode all-reduce (12 KB), plus the ring's further bytes at the link rate for
    larger messages: the brief has no NCCL time at other sizes."""
    extra = max(0, nccl_ring_bytes(nbytes, world) - nccl_ring_bytes(DECODE_BYTES, world))
    return NCCL_US.value + extra * 1e-3 / LINK_GBPS.value


def size_rows(box: Box, m: Measured, sizes: Sequence[int]) -> list[dict]:
    rows = []
    for n in sizes:
        for a in algos_for(box):
            p = predict(a, n, box, m)
            rows.append({"box": box.name, "size": n, "count": n // 2, "type": "bfloat16", "redop": "sum",
                         "impl": a, "us": p.us, "wire_bytes": p.wire, "cross_bytes": p.cross,
                         "read_bytes": p.inbound, "parts": dict(p.parts), "label": "model"})
        rows.append({"box": box.name, "size": n, "count": n // 2, "type": "bfloat16", "redop": "sum",
                     "impl": "nccl (brief)", "us": nccl_us(n, box.world), "wire_bytes": nccl_ring_bytes(n, box.world),
                     "cross_bytes": None, "read_bytes": None, "parts": {"brief": nccl_us(n, box.world)},
                     "label": "model"})
    return rows


def report(m: Measured, sizes: Sequence[int] = SIZES) -> dict:
    return {"label": "model", "world": WORLD,
            "measured": [dataclasses.asdict(c) for c in m.constants()],
            "assumptions": [dataclasses.asdict(c) for c in ASSUMPTIONS]
            + [{"name": "decode_step", "value": BRIEF_STEP_MS, "unit": "ms",
                "source": f"the brief: 43 tok/s with NCCL at {NCCL_US.value:g} us, {ALLREDUCES_PER_STEP} "
                          "all-reduces per step"}],
            "rows": [r for b in BOXES for r in size_rows(b, m, sizes)],
            "saves": {b.name: saves(b, m) for b in BOXES}}


def render(rep: dict) -> list[str]:
    w = rep["world"]
    lines = ["# MODEL, not a measurement: fastcomm all-reduce on 8 GPUs over PCIe Gen5 (python -m "
             "fastcomm_bench.pcie_model)", "# measured on 2 x H200 (bench/results):"]
    lines += [f"#   {c['name']:<24} {c['value']:>10.4g} {c['unit']:<5} {c['source']}" for c in rep["measured"]]
    lines.append("# assumed:")
    lines += [f"#   {c['name']:<24} {c['value']:>10.4g} {c['unit']:<5} {c['source']}" for c in rep["assumptions"]]
    box = None
    for r in rep["rows"]:
        if r["box"] != box:
            box = r["box"]
            lines += ["", f"# {box}, {w} ranks, bf16; time = modelled us per call",
                      f"#{'size':>9} {'count':>8} {'type':>8} {'redop':>5} {'impl':>14} {'time us':>8} {'algbw':>6} "
                      f"{'busbw':>6} {'wire B/GPU':>10} {'cross B':>8} {'read B':>8} {'label':>5}"]
        algbw = r["size"] / (r["us"] * 1e-6) / 1e9
        cross = "-" if r["cross_bytes"] is None else r["cross_bytes"]
        read = "-" if r["read_bytes"] is None else r["read_bytes"]
        lines.append(f" {r['size']:>9} {r['count']:>8} {r['type']:>8} {r['redop']:>5} {r['impl']:>14} "
                     f"{r['us']:>8.2f} {algbw:>6.2f} {algbw * 2 * (w - 1) / w:>6.2f} {r['wire_bytes']:>10} "
                     f"{cross:>8} {read:>8} {r['label']:>5}")
    for name, rows in rep["saves"].items():
        lines += ["", f"# what each change saves, {name}, 12 KB (1 x {HIDDEN} bf16), {ALLREDUCES_PER_STEP} "
                  f"all-reduces per step, the brief's {BRIEF_STEP_MS} ms step at NCCL's {NCCL_US.value:g} us",
                  "| change | us per all-reduce | saves us | saves ms / step | step ms | tok/s | |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['change']} | {r['us']:.2f} | {r['saves_us']:.2f} | {r['saves_ms_per_step']:.2f} | "
                  f"{r['step_ms']:.2f} | {r['tok_s']:.1f} | {r['label']} |" for r in rows]
    return lines


def markdown(rep: dict) -> list[str]:
    """The summary RESULTS.md shows: us per call by size per box for the current kernels (the kernels before
    issue 15's, ``-old``, and what each change saved are the full report's: ``render``)."""
    sizes = sorted({r["size"] for r in rep["rows"]})
    lines = [f"| 8 GPUs, us per call | {' | '.join(format_size(s, True) for s in sizes)} | |",
             "|---|" + "---|" * (len(sizes) + 1)]
    cells: dict = {}
    for r in rep["rows"]:
        if not r["impl"].endswith("-old"):
            cells.setdefault((r["box"].removeprefix("8 x PCIe Gen5, "), r["impl"]), {})[r["size"]] = r["us"]
    lines += [f"| {box}: {impl} | {' | '.join(f'{us[s]:.1f}' for s in sizes)} | model |"
              for (box, impl), us in cells.items()]
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m fastcomm_bench.pcie_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=str(RESULTS), help="folder of the committed fastcomm bench files")
    p.add_argument("--sizes", default=",".join(format_size(s, True) for s in SIZES), help="message sizes, e.g. 4K,12K")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--markdown", action="store_true", help="print the summary tables bench/RESULTS.md shows")
    a = p.parse_args(argv)
    try:
        sizes = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
        rep = report(measure(Path(a.results)), sizes)
    except ValueError as e:
        p.error(str(e))
    print("\n".join(markdown(rep) if a.markdown else render(rep)))
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=1) + "\n")


if __name__ == "__main__":
    main()
