"""GGUF decode products at GLM-5's shapes: vllm-gguf-plugin's CUDA kernels against fastcomm's (csrc/kquant/kquant.cu).

    python -m fastcomm_bench.gguf_kernels [--tokens 1,2,4,8] [--json OUT]
    python -m fastcomm_bench.gguf_kernels --tokens 64,256   # a prefill's products (needs the plugin)
    python -m fastcomm_bench.gguf_kernels --suggest OUT    # the token thresholds a saved run suggests
    python -m fastcomm_bench.gguf_kernels --tp 8 --tokens 1,2   # one rank's products at tensor parallel 8
    python -m fastcomm_bench.gguf_kernels --tp 8 --tokens 1,2,3,4,5,6,7,8 --forms-out FILE   # this GPU's forms
    python -m fastcomm_bench.gguf_kernels --forms-from RUN.json --forms-out FILE   # a saved run's forms
    python -m fastcomm_bench.gguf_kernels --tp 8 --tokens 1,2,3,4,5,6,7,8 --save-forms  # served here from now on
    python -m fastcomm_bench.gguf_kernels --compare BASE.json OTHER.json   # two runs (e.g. ab's trees) side by side

Every product of one GLM-5 decoder layer at full width (the 78-layer benchmark model's shapes and UD-Q4_K_XL
types, fastcomm_vllm/gguf/synth.py), the LM head, and the routed experts (16 experts, top 8; at ``--tp`` GLM-5's 256,
routed as the TP 8 shard's routers spread a step's tokens, none shared): GPU time per call for the
plugin's path (as its ``apply`` runs it: per-shard copies for a mixed-type fused weight, GEMV up to its
``mmvq_safe`` batch, else its MMQ GEMM; MoE through ``ggml_moe_a8_vec``), fastcomm's in every form (linears:
``mma`` on the tensor cores, ``staged`` and ``unstaged`` dp4a; MoE: ``grouped`` by expert on the tensor cores,
``pairs`` dp4a per (token, expert) pair, ``shared``: grouped with a block's warps sharing each unit's
activations, ``staged``: pairs in two launches that quantize their own activations (None where its stage
exceeds a block's shared memory); kquant.FORMS_*), the form its policy takes marked (kquant.linear_form /
moe_form, whose thresholds come from this table), and a bf16 cuBLAS matmul of the same shape for scale. Each
timing is a CUDA graph of 16 calls replayed (launch overhead out, as in vLLM's decode graphs; each call after
a one-element torch add, whose own time is taken off, as another library's kernel stands between two products
in a decode step), over enough copies of the weight (of 256 experts: routes) that no call finds it in L2.
Also checks that fastcomm's result matches the plugin's (relative error), and prints a per-step sum: 75 MoE layers, 3 dense layers and the
LM head, as in one decode step of the 78-layer model. FASTCOMM_GGUF_PDL=0 times the mma form launched plainly.
Token counts past fastcomm's 1-8 are a prefill's: the plugin's path against the weights dequantized to bf16 on
the tensor cores (``dequant``: cuBLAS for the linears, vLLM's fused_experts for the MoE; the weights written by
kquant.DEQUANT_KERNEL, and by the other dequantizer as ``dequant_<it>``) and against fastcomm's kernels 8
tokens a call, the MoE up to 32 (``chunks``, also timed launched eagerly as a prefill runs them: ``eager``);
the form kquant.prefill_form takes marked; no LM head (a prefill's logits are its last positions').
``--tp N``: one rank's share at tensor parallel N (``tp_shapes``: vLLM's column-parallel outputs and row-parallel
inputs divided by N, the replicated products whole), where launches, not bytes, bound the small products.
``--forms-out FILE``: the run's fastest form of each product at each decode token count as a forms table
(fastcomm.kquant.forms, which FASTCOMM_GGUF_FORMS=FILE serves; a table for a GPU goes in fastcomm/kquant/tables/).
Needs a GPU; the plugin's rows need vllm-gguf-plugin with its CUDA extension (without it they read '-').
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import numpy as np

from fastcomm import kquant
from fastcomm.kquant import MAX_TOKENS as MAX_DECODE  # rows past it are a prefill's

CALLS_PER_GRAPH = 16
# The dequantizer the policy does not take (kquant.DEQUANT_KERNEL's other), timed beside it: dequant_<it>_us.
OTHER_DEQUANT = next(k for k in kquant.DEQUANT_KERNELS if k != kquant.DEQUANT_KERNEL)
SHARED_WARPS = (2, 8)  # the MoE's shared form at these block sizes too, beside kquant.MOE_SHARED_WARPS
L2_CLEAR_BYTES = 256 << 20


def _blocks(rng, qtype, rows_shape, cols):
    import gguf

    from fastcomm_vllm.gguf.synth import make_tensor

    stored, _ = make_tensor(rng, gguf.GGMLQuantizationType[qtype], (*rows_shape, cols))
    return np.ascontiguousarray(stored, np.uint8)


def _graph_time_us(fns) -> float:
    """GPU time of one call: a graph of CALLS_PER_GRAPH calls (cycling over ``fns``), each after a one-element
    torch add, replayed; minus the same graph of the adds alone. Why the add: in a decode step another
    library's kernel (a norm, the attention, an all-reduce) stands between two products, so one product's
    kernels cannot overlap the next one's (programmatic dependent launch, FASTCOMM_GGUF_PDL), and neither may
    they here."""
    import torch

    fence = torch.zeros(1, device="cuda")
    return _replay_us(fns, fence) - _replay_us([], fence)


def _replay_us(fns, fence) -> float:
    import torch

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for f in fns:
            f()
        fence.add_(1)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(CALLS_PER_GRAPH):
            fence.add_(1)
            if fns:
                fns[i % len(fns)]()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / (reps * CALLS_PER_GRAPH)


LINEARS = (  # name, [(type, rows)] shards in output order, cols, layers per step that run it
    ("fused_qkv_a (q_a Q5_K + kv_a Q8_0)", [("Q5_K", 2048), ("Q8_0", 576)], 6144, 78),
    ("q_b", [("Q4_K", 16384)], 2048, 78),
    ("indexer wq_b", [("Q8_0", 4096)], 2048, 78),
    ("o_proj", [("Q4_K", 6144)], 16384, 78),
    ("shared gate_up", [("Q4_K", 4096)], 6144, 75),
    ("shared down", [("Q6_K", 6144)], 2048, 75),
    ("dense gate_up", [("Q4_K", 24576)], 6144, 3),
    ("dense down", [("Q6_K", 6144)], 12288, 3),
    ("lm_head", [("Q6_K", 154880)], 6144, 1),
)
MOE_OP = "routed experts"  # the MoE row's op, before its parenthesis (which says its experts, top-k and types)


def moe_op(experts: int, topk: int, t13: str, t2: str) -> str:
    return f"{MOE_OP} ({experts}, top {topk}; {t13} up, {t2} down)"


MOE = (moe_op(16, 8, "Q4_K", "Q5_K"), 16, 8, 6144, 2048, "Q4_K", "Q5_K", 75)
# One TP 8 rank (tp_shapes) holds every one of GLM-5's 256 experts (a slice of each), as the TP 8 shard does: its
# verify steps read 8 distinct experts a token (synth's routers), which 16 cannot give past 2 tokens.
TP_EXPERTS = 256
# How vLLM's GLM-5 (DSA) splits each of LINEARS at tensor parallel: "out" column-parallel (rows / TP), "in"
# row-parallel (cols / TP), None replicated (the fused q_a/kv_a and the indexer's wq_b run whole on every rank).
SPLIT = {"fused_qkv_a": None, "q_b": "out", "indexer wq_b": None, "o_proj": "in", "shared gate_up": "out",
         "shared down": "in", "dense gate_up": "out", "dense down": "in", "lm_head": "out"}


def tp_shapes(tp: int):
    """(LINEARS, MOE) for one rank at tensor parallel ``tp``: SPLIT's products divided, the experts' intermediate
    size divided (every rank holds every expert's slice). A split must keep whole 256-wide blocks of K and
    whole rows, as the GGUF loader requires; a TP that breaks one is refused."""
    if tp == 1:
        return LINEARS, MOE
    linears = []
    for name, shards, cols, layers in LINEARS:
        split = SPLIT[name.split(" (")[0]]
        if (split == "out" and any(rows % tp for _, rows in shards)) or (split == "in" and cols % (256 * tp)):
            raise ValueError(f"{name} does not split in whole rows and 256-wide blocks at tensor parallel {tp}")
        if split == "out":
            shards = [(q, rows // tp) for q, rows in shards]
        elif split == "in":
            cols //= tp
        linears.append((name, shards, cols, layers))
    _, _, topk, hidden, inter, t13, t2, layers = MOE
    if inter % (256 * tp):
        raise ValueError(f"the experts' intermediate size {inter} does not split in 256-wide blocks at TP {tp}")
    return tuple(linears), (moe_op(TP_EXPERTS, topk, t13, t2), TP_EXPERTS, topk, hidden, inter // tp, t13, t2, layers)


def op_name(op: str) -> str:
    """A row's product by its short name (the name before any parenthesis): one name at every TP."""
    return op.split(" (")[0]


def forms_shapes(tp: int) -> dict:
    """Each op of a run at tensor parallel ``tp`` (its rows' ``op``) as the forms table keys it: the shape a
    vLLM layer of one rank has (kquant.forms.LinearShape / MoeShape)."""
    from fastcomm.kquant import forms

    by_name = forms.TYPE_IDS
    linears, moe = tp_shapes(tp)
    out = {op_name(name): forms.LinearShape(tuple(by_name[t] for t, _ in shards), tuple(r for _, r in shards), cols)
           for name, shards, cols, _ in linears}
    _, _, topk, hidden, inter, t13, t2, _ = moe
    out[MOE_OP] = forms.MoeShape(by_name[t13], by_name[t2], hidden, inter, topk)
    return out


def forms_table(run: dict, source: str):
    """The forms table of a run (``--json``'s record: its device, tp and rows), named for the GPU its launches
    planned for (kquant.limits' name: under FASTCOMM_TEST_DEVICE_LIMITS the emulated one's, which is not the
    GPU that timed it, so no table of the GPU at hand comes of an emulated run)."""
    from fastcomm.kquant import forms

    device = run.get("limits", {}).get("name") or run["device"]
    shapes = forms_shapes(run.get("tp", 1))
    by_op = {r["op"]: shapes[op_name(r["op"])] for r in run["rows"] if op_name(r["op"]) in shapes}
    return forms.from_rows(run["rows"], by_op, device, source)


def _default_us(r) -> float:
    return r[f"{r['default']}_us"]


def _plugin(module: str):
    """The plugin's module, or None where it is not installed (then its rows read '-')."""
    import importlib

    try:
        return importlib.import_module(f"vllm_gguf_plugin.quantization.{module}")
    except ImportError:
        return None


def linear_weight(rng, shards, cols):
    """A linear layer's weight as the plugin stores it (shards of ``(type, rows)`` one under the other, rows
    padded to the widest): (uint8 array, per shard (start row, end row, bytes used of a row), kquant segments,
    ggml type ids)."""
    import gguf

    stored = [_blocks(rng, t, (r,), cols) for t, r in shards]
    width = max(s.shape[1] for s in stored)
    padded = np.zeros((sum(r for _, r in shards), width), np.uint8)
    offsets, start = [], 0
    for s in stored:
        padded[start:start + s.shape[0], :s.shape[1]] = s
        offsets.append((start, start + s.shape[0], s.shape[1]))
        start += s.shape[0]
    types = [int(gguf.GGMLQuantizationType[t]) for t, _ in shards]
    return padded, offsets, kquant.plan_linear(types, offsets, width, cols), types


def pdl_setting() -> bool:
    """FASTCOMM_GGUF_PDL, which the vLLM plugin hands the kernels (kquant_vllm.install) and the benchmarks take
    here (e.g. FASTCOMM_GGUF_PDL=0 for a table without dependent launches)."""
    from fastcomm.kquant.settings import Settings

    return Settings.from_env().pdl


def moe_staged() -> bool:
    """FASTCOMM_GGUF_MOE_STAGED, which marks the policy's form of the routed experts at 1-2 tokens."""
    from fastcomm.kquant.settings import Settings

    return Settings.from_env().moe_staged


def prefill_settings() -> tuple[int, int, int]:
    """FASTCOMM_GGUF_DEQUANT_MIN_TOKENS / _DEQUANT_MOE_MIN / _CHUNK_MAX_TOKENS, which mark the policy's form of a
    prefill's rows."""
    from fastcomm.kquant.settings import Settings

    s = Settings.from_env()
    return s.dequant_min_tokens, s.dequant_moe_min, s.chunk_max_tokens


def _eager_us(fn) -> float:
    """GPU-timeline time of one call run eagerly, 8 back to back (as vLLM runs a prefill outside its graphs):
    where the host cannot launch a call's kernels as fast as the GPU runs them, the gaps count."""
    import torch

    from fastcomm.measure import timers

    return timers(torch, fn, calls=8, iters=3, warmup=1, graph=False)


def _rel_diff(got, ref) -> float:
    got, ref = got.float(), ref.float()
    return round(float((got - ref).norm() / ref.norm()), 5)


def _prefill_times(plugin, dequant, weights, chunked) -> dict:
    """A prefill row's times and differences: the plugin's calls (``plugin``, one per weight copy), the
    dequantized form (``dequant(weight, kernel=)`` on each of ``weights``) with kquant.DEQUANT_KERNEL and with
    OTHER_DEQUANT, and the chunked calls (``chunked``) in a graph and launched eagerly; each form's result
    against the plugin's."""
    mine = [lambda w=w: dequant(w) for w in weights]
    alt = [lambda w=w: dequant(w, kernel=OTHER_DEQUANT) for w in weights]
    ref = plugin[0]()
    return {"plugin_us": round(_graph_time_us(plugin), 2), "dequant_us": round(_graph_time_us(mine), 2),
            "dequant_kernel": kquant.DEQUANT_KERNEL, f"dequant_{OTHER_DEQUANT}_us": round(_graph_time_us(alt), 2),
            "chunks_us": round(_graph_time_us(chunked), 2), "chunks_eager_us": round(_eager_us(chunked[0]), 2),
            "rel_diff_vs_plugin": _rel_diff(mine[0](), ref), "chunks_rel_diff_vs_plugin": _rel_diff(chunked[0](), ref)}


def bench_linear(name, shards, cols, tokens, rng):
    """Rows of one linear at each of ``tokens``: up to kquant.MAX_TOKENS (a decode step) the plugin's path and
    fastcomm's forms; past it (a prefill, which only the plugin's kernels served) the plugin's path and the
    weight dequantized for cuBLAS (kquant_vllm.dequant_linear), where the plugin is installed."""
    import torch

    from fastcomm_vllm.gguf import kquant_vllm

    plin = _plugin("linear")
    pdl = pdl_setting()
    padded, offsets, segs, types = linear_weight(rng, shards, cols)
    rows = padded.shape[0]
    nbytes = padded.nbytes
    copies = max(1, min(8, math.ceil(L2_CLEAR_BYTES / nbytes)))
    ws = [torch.from_numpy(padded).cuda() for _ in range(copies)]
    dense = [torch.randn(rows, cols, dtype=torch.bfloat16, device="cuda") for _ in range(max(1, copies // 4))]
    rowsout = []
    for n in tokens:
        x = torch.randn(n, cols, dtype=torch.bfloat16, device="cuda") * 0.1

        def plugin(w):
            if len(types) == 1:
                return lambda: plin._fused_mul_mat_gguf(x, w, types[0])
            return lambda: torch.cat([plin._fused_mul_mat_gguf(x, w[s:e, :u].contiguous(), t)
                                      for t, (s, e, u) in zip(types, offsets)], dim=1)

        if n > MAX_DECODE:
            if not plin:
                continue
            starts, nrows = [s.start for s in segs], [s.rows for s in segs]

            def dequant(w, kernel=None, x=x):
                return kquant_vllm.dequant_linear(x, w, types, starts, nrows, kernel=kernel)

            chunked = [lambda w=w: kquant.linear_chunks(x, w, segs, pdl=pdl) for w in ws]
            dequant_min, _, chunk_max = prefill_settings()
            row = {"op": name, "tokens": n, "weight_MB": round(nbytes / 1e6, 2),
                   "default": kquant.prefill_form(n, chunk_max, dequant_min, host_bound=True),  # eager
                   **_prefill_times([plugin(w) for w in ws], dequant, ws, chunked),
                   "bf16_cublas_us": round(_graph_time_us([lambda d=d: x @ d.T for d in dense]), 2)}
            rowsout.append(row)
            continue
        default = kquant.linear_form(n, kquant.mma_ok(segs, cols), kquant.staged_fits(x.device.index, n, cols),
                                     cols=cols)
        row = {"op": name, "tokens": n, "weight_MB": round(nbytes / 1e6, 2),
               "plugin_us": round(_graph_time_us([plugin(w) for w in ws]), 2) if plin else None, "default": default,
               "mma_entry": kquant.mma_variant(types, moe=False) or "any",  # the kernel entry the mma form runs
               "mma_warps": kquant.launch_warps(0, kquant.abi.KQ_MMA, "bfloat16", [s.type for s in segs], cols,
                                                kquant.tiles(sum(s.rows for s in segs)))}
        for form in kquant.FORMS_LINEAR:
            row[f"{form}_us"] = round(_graph_time_us([lambda w=w, f=form: kquant.linear(x, w, segs, form=f, pdl=pdl)
                                                      for w in ws]), 2)
        row["bf16_cublas_us"] = round(_graph_time_us([lambda d=d: x @ d.T for d in dense]), 2)
        row["rel_diff_vs_plugin"] = None
        if plin:
            mine, theirs = kquant.linear(x, ws[0], segs, pdl=pdl), plugin(ws[0])()
            row["rel_diff_vs_plugin"] = _rel_diff(mine, theirs)
        rowsout.append(row)
    return rowsout


def linear_shapes() -> dict[str, tuple[list, int]]:
    """LINEARS by short name (the name before any parenthesis): (shards, cols)."""
    return {name.split(" (")[0]: (shards, cols) for name, shards, cols, _ in LINEARS}


def moe_weights(rng, moe=MOE):
    """The routed experts as the plugin stores them, at ``moe``'s shapes and types (MOE, or one rank's:
    tp_shapes): (w13, w2) uint8 arrays and their ggml type ids (q13, q2). Past 16 experts, 16 made and repeated:
    what a call reads is distinct memory all the same, and making 256 (with their float truth) takes minutes."""
    import gguf

    _, experts, _, hidden, inter, t13, t2, _ = moe
    made = min(experts, 16)
    w13 = _blocks(rng, t13, (made, 2 * inter), hidden)
    w2 = _blocks(rng, t2, (made, hidden), inter)
    reps = -(-experts // made)
    w13, w2 = (np.ascontiguousarray(np.tile(w, (reps, 1, 1))[:experts]) for w in (w13, w2))
    return w13, w2, int(gguf.GGMLQuantizationType[t13]), int(gguf.GGMLQuantizationType[t2])


def moe_inputs(n: int, moe=MOE, rng=None):
    """n tokens for ``moe`` on the GPU: activations (bf16), routes (int32) and router weights. The routes are
    ``route_ids``'."""
    import torch

    _, experts, topk, hidden, *_ = moe
    x = torch.randn(n, hidden, dtype=torch.bfloat16, device="cuda") * 0.1
    ids = torch.from_numpy(route_ids(n, experts, topk, rng or np.random.default_rng(n))).cuda()
    return x, ids, torch.rand(n, topk, device="cuda")


def route_ids(n: int, experts: int, topk: int, rng) -> np.ndarray:
    """[n, topk] int32 routes: topk distinct experts a token, and distinct across the tokens where the experts
    allow it (n x topk of them), as the TP 8 shard's routers spread a verify step's tokens; else each token's
    own draw."""
    if n * topk <= experts:
        return rng.permutation(experts)[:n * topk].reshape(n, topk).astype(np.int32)
    return np.stack([rng.permutation(experts)[:topk] for _ in range(n)]).astype(np.int32)


def bench_moe(tokens, rng, moe=MOE):
    """Rows of the routed experts at each of ``tokens``, as bench_linear's (past kquant.MAX_TOKENS: the
    plugin's path and every expert dequantized for vLLM's fused_experts, kquant_vllm.dequant_moe)."""
    import torch

    from fastcomm_vllm.gguf import kquant_vllm

    pmoe = _plugin("fused_moe")

    name, experts, topk, hidden, inter, *_ = moe
    w13, w2, q13, q2 = moe_weights(rng, moe)
    nbytes = w13.nbytes + w2.nbytes
    copies = max(1, min(4, math.ceil(L2_CLEAR_BYTES / nbytes)))
    w13s = [torch.from_numpy(w13).cuda() for _ in range(copies)]
    w2s = [torch.from_numpy(w2).cuda() for _ in range(copies)]
    act = None  # silu=True: the quantize launch applies silu(gate) * up itself
    out = []
    for n in tokens:
        x, ids, wts = moe_inputs(n, moe)
        # the bytes of the distinct experts this routing reads (the grouped form reads each once)
        distinct = len(set(ids.flatten().tolist()))
        # Where the experts outnumber a call's routes (the TP 8 shard's 256), the graph's calls take different
        # routes, as a step's layers do, so that no call finds in L2 what the one before it read; with few
        # experts (16) the weights' copies do that.
        read = nbytes * distinct / experts * copies
        sets = max(1, min(CALLS_PER_GRAPH, math.ceil(L2_CLEAR_BYTES / read))) if experts >= 2 * n * topk else 1
        routes = [ids] + [torch.from_numpy(route_ids(n, experts, topk, np.random.default_rng(1000 * n + k))).cuda()
                          for k in range(1, sets)]
        calls = [(a, b, r) for a, b in zip(w13s, w2s) for r in routes]
        plugin = [lambda a=a, b=b, r=r: pmoe._fused_moe_gguf(x, a, b, wts, r, q13, q2, "silu") for a, b, r in calls]
        if n > MAX_DECODE:
            if not pmoe:
                continue
            def dequant(ab, kernel=None, x=x, ids=ids, wts=wts):
                return kquant_vllm.dequant_moe(x, *ab, wts, ids, q13, q2, "silu", kernel=kernel)

            chunked = [lambda a=a, b=b: kquant.moe_chunks(x, a, b, wts, ids, q13, q2, act, silu=True)
                       for a, b in zip(w13s, w2s)]
            _, dequant_moe_min, chunk_max = prefill_settings()
            row = {"op": name, "tokens": n, "weight_MB_read": round(nbytes * distinct / experts / 1e6, 1),
                   "experts": experts, "default": kquant.moe_prefill_form(n, topk, experts, chunk_max, dequant_moe_min),
                   **_prefill_times(plugin[::len(routes)], dequant, list(zip(w13s, w2s)), chunked)}
            out.append(row)
            continue
        row = {"op": name, "tokens": n, "weight_MB_read": round(nbytes * distinct / experts / 1e6, 1),
               "experts": experts, "route_sets": sets, "plugin_us": round(_graph_time_us(plugin), 2) if pmoe else None,
               "default": kquant.moe_form(n, topk, hidden, inter, staged=moe_staged(),
                                          smem_per_block=kquant.limits(0).smem_per_block),
               "mma_entry": "/".join(kquant.mma_variant([q], moe=True) or "any" for q in (q13, q2))}
        for form in kquant.FORMS_MOE:
            staged_out = form == "staged" and \
                kquant.moe_stage_bytes(n, topk, hidden, inter) > kquant.limits(0).smem_per_block
            row[f"{form}_us"] = None if staged_out else round(_graph_time_us([lambda a=a, b=b, r=r, f=form: kquant.moe(
                x, a, b, wts, r, q13, q2, act, silu=True, form=f) for a, b, r in calls]), 2)
        for w in SHARED_WARPS:  # the shared form at other block sizes than its default (columns shared_wN)
            fits = max(kquant.moe_shared_smem([q], w) for q in (q13, q2)) <= kquant.limits(0).smem_per_block
            row[f"shared_w{w}_us"] = round(_graph_time_us([lambda a=a, b=b, r=r: kquant.moe(
                x, a, b, wts, r, q13, q2, act, silu=True, form="shared", shared_warps=w)
                for a, b, r in calls]), 2) if fits else None  # None: its block does not fit the GPU
        busy = min(experts, n * topk)
        row["grouped_warps"] = [kquant.launch_warps(0, kquant.abi.KQ_MOE_MMA_UP, "bfloat16", [q13], hidden,
                                                    kquant.tiles(2 * inter) * busy, moe=True),
                                kquant.launch_warps(0, kquant.abi.KQ_MOE_MMA_DOWN, None, [q2], inter,
                                                    kquant.tiles(hidden) * busy, moe=True)]
        row["rel_diff_vs_plugin"] = None
        if pmoe:
            mine = kquant.moe(x, w13s[0], w2s[0], wts, ids, q13, q2, act, silu=True)
            theirs = plugin[0]()  # calls[0]: the first copy and ids
            row["rel_diff_vs_plugin"] = _rel_diff(mine, theirs)
        out.append(row)
    return out


NOT_FORMS = ("plugin_us", "bf16_cublas_us", "chunks_eager_us")  # times of a row that are no fastcomm form's


def _forms(r) -> list[str]:
    return [k[:-3] for k in r if k.endswith("_us") and k not in NOT_FORMS]


def _best_us(r) -> float:
    return min(r[f"{f}_us"] for f in _forms(r))


def _moe_experts(rows: list[dict]) -> int:
    """The experts of a run's MoE rows (runs before the rows said: MOE's 16)."""
    return next((r["experts"] for r in rows if op_name(r["op"]) == MOE_OP and "experts" in r), MOE[1])


def _layers() -> dict[str, int]:
    """Layers of one decode step that run each product, by ``op_name``."""
    return {**{op_name(name): layers for name, _, _, layers in LINEARS}, MOE_OP: MOE[-1]}


def report(rows: list[dict], tokens: list[int]) -> tuple[str, dict]:
    """The markdown table of ``rows`` and, per token count, the per-step sums (ms) of one decode step: the
    plugin's, fastcomm's in the forms its policy takes, and in the fastest form of each product."""
    per_layer = _layers()
    lines = ["| op | tokens | MB | plugin us | fastcomm us (policy's form) | speed-up | every form, us | "
             "bf16 cuBLAS us | rel diff |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mb = r.get("weight_MB", r.get("weight_MB_read"))
        forms = ", ".join(f"{f} {r[f'{f}_us']}" for f in _forms(r))
        if "chunks_eager_us" in r:  # the chunks launched eagerly, as a prefill outside vLLM's graphs runs them
            forms += f" (eager {r['chunks_eager_us']})"
        plugin = r["plugin_us"]
        lines.append(f"| {r['op']} | {r['tokens']} | {mb} | {plugin if plugin else '-'} | {_default_us(r)} "
                     f"({r['default']}) | {f'{plugin / _default_us(r):.2f}x' if plugin else '-'} | {forms} | "
                     f"{r.get('bf16_cublas_us', '-')} | {r['rel_diff_vs_plugin'] or '-'} |")
    steps = {}
    for n in tokens:
        sel = [r for r in rows if r["tokens"] == n]
        if not sel:  # a prefill's count without the plugin: no rows
            continue
        weigh = lambda us: round(sum(us(r) * per_layer[op_name(r["op"])] for r in sel) / 1000, 2)  # noqa: E731
        plugin = all(r["plugin_us"] for r in sel)
        steps[n] = {"plugin_us": weigh(lambda r: r["plugin_us"]) if plugin else None,
                    "fastcomm_default_us": weigh(_default_us),
                    "fastcomm_best_us": weigh(_best_us)}
        what = f"decode step at {n} token(s)" if n <= MAX_DECODE else f"prefill of {n} tokens (no LM head)"
        lines.append(f"# per {what}, these products only (ms): plugin {steps[n]['plugin_us']}, "
                     f"fastcomm {steps[n]['fastcomm_default_us']} (the fastest form of each: "
                     f"{steps[n]['fastcomm_best_us']})")
    return "\n".join(lines), steps


NEVER = 9  # a threshold above every decode batch (FASTCOMM_GGUF_*_MIN_TOKENS=9)


def suggest(rows: list[dict]) -> dict[str, int]:
    """Token thresholds from a run's rows: the fewest measured tokens from which, at every larger measured count
    too, the per-step sum of the linears in the mma form (of the MoE grouped) beats the dp4a forms' best. As
    FASTCOMM_GGUF_MMA_MIN_TOKENS / _GROUPED_MIN_TOKENS take them. Where the run has prefill rows, the same for
    the dequantized forms against the plugin's (FASTCOMM_GGUF_DEQUANT_MIN_TOKENS, and _MOE_MIN as routed tokens
    an expert; 0: never)."""
    per_layer = _layers()

    def threshold(rows, tensor, dp4a, ops, never) -> int:
        mine = [r for r in rows if op_name(r["op"]) in ops]
        tokens = sorted({r["tokens"] for r in mine})
        wins = {n: sum(tensor(r) * per_layer[op_name(r["op"])] for r in mine if r["tokens"] == n)
                < sum(dp4a(r) * per_layer[op_name(r["op"])] for r in mine if r["tokens"] == n)
                for n in tokens}
        best = never
        for n in reversed(tokens):
            if not wins[n]:
                break
            best = n
        return best

    linears = {op_name(name) for name, _, _, _ in LINEARS}
    decode = [r for r in rows if r["tokens"] <= MAX_DECODE]
    out = {"mma_min_tokens": threshold(decode, lambda r: r["mma_us"], lambda r: min(r["staged_us"], r["unstaged_us"]),
                                       linears, NEVER),
           "grouped_min_tokens": threshold(decode, lambda r: r["grouped_us"], lambda r: r["pairs_us"], {MOE_OP},
                                           NEVER)}
    prefill = [r for r in rows if r["tokens"] > MAX_DECODE]
    if prefill:
        # The dequantized forms against the better of the others a prefill can take: the plugin's, and for the MoE
        # the chunks (a linear's eager chunks are host-bound: kquant.prefill_form; runs before chunks_us existed:
        # the plugin's).
        def other(r):
            return (min(r["plugin_us"], _chunks_us(r)) if "chunks_us" in r and op_name(r["op"]) == MOE_OP
                    else r["plugin_us"])

        out["dequant_min_tokens"] = threshold(prefill, dequant_us, other, linears, 0)
        n = threshold(prefill, dequant_us, other, {MOE_OP}, 0)
        experts, topk = _moe_experts(rows), MOE[2]
        out["dequant_moe_min"] = -(-n * topk // experts)  # the same tokens as routed pairs an expert
        if all("chunks_us" in r for r in prefill):
            out["chunk_max_tokens"] = chunk_limit(prefill, out["dequant_min_tokens"], out["dequant_moe_min"])
    return out


def dequant_us(r, kernel: str = kquant.DEQUANT_KERNEL) -> float:
    """A prefill row's dequantized form with ``kernel`` (kquant.DEQUANT_KERNELS): the row's ``dequant_us`` is
    the kernel its run's policy took (``dequant_kernel``; runs before that field: the plugin's), the other's
    ``dequant_<kernel>_us``."""
    key = "dequant_us" if r.get("dequant_kernel", "plugin") == kernel else f"dequant_{kernel}_us"
    return r.get(key, r["dequant_us"])  # a run that timed one dequantizer: that one's time


def _chunks_us(r) -> float:
    """A prefill row's chunks as a prefill runs them: launched eagerly (host gaps included), where the run has
    that time."""
    return r.get("chunks_eager_us", r["chunks_us"])


def chunk_limit(prefill: list[dict], dequant_min: int, dequant_moe_min: int) -> int:
    """FASTCOMM_GGUF_CHUNK_MAX_TOKENS from a run's prefill rows and the dequantized forms' thresholds: the most
    measured tokens up to which, at every smaller measured count too, the products the policy chunks in a prefill
    (neither dequantized nor, launched eagerly, a linear: kquant.prefill_form's ``host_bound``) sum to no more per
    step in calls of 8 tokens (``_chunks_us``) than through the plugin's kernels (0: never).
    A count where the dequantized forms take every such product extends a limit the chunks reached (the policy
    tries the dequantized form first, so the chunks serve every count below it), and starts none."""
    per_layer = _layers()
    experts, topk = _moe_experts(prefill), MOE[2]
    limit = 0
    for n in sorted({r["tokens"] for r in prefill}):
        sel = [r for r in prefill if r["tokens"] == n]
        forms = {r["op"]: kquant.moe_prefill_form(n, topk, experts, n, dequant_moe_min)
                 if op_name(r["op"]) == MOE_OP else kquant.prefill_form(n, n, dequant_min, host_bound=True)
                 for r in sel}
        chunked = [r for r in sel if forms[r["op"]] == "chunks"]
        if not chunked:  # the dequantized forms take every product at n: chunks that started serve up to it
            if limit:
                limit = n
            continue
        if sum(_chunks_us(r) * per_layer[op_name(r["op"])] for r in chunked) > \
                sum(r["plugin_us"] * per_layer[op_name(r["op"])] for r in chunked):
            break
        limit = n
    return limit


def _settings(thresholds: dict[str, int]) -> str:
    text = (f"FASTCOMM_GGUF_MMA_MIN_TOKENS={thresholds['mma_min_tokens']} "
            f"FASTCOMM_GGUF_GROUPED_MIN_TOKENS={thresholds['grouped_min_tokens']}")
    if "dequant_min_tokens" in thresholds:
        text += (f" FASTCOMM_GGUF_DEQUANT_MIN_TOKENS={thresholds['dequant_min_tokens']}"
                 f" FASTCOMM_GGUF_DEQUANT_MOE_MIN={thresholds['dequant_moe_min']}")
    if "chunk_max_tokens" in thresholds:
        text += f" FASTCOMM_GGUF_CHUNK_MAX_TOKENS={thresholds['chunk_max_tokens']}"
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastcomm_bench.gguf_kernels", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--json", default=None)
    p.add_argument("--tp", type=int, default=1, help="time one rank's share at this tensor parallel size")
    p.add_argument("--suggest", metavar="JSON", default=None,
                   help="print the thresholds a saved run suggests, as FASTCOMM_GGUF_* settings, and exit")
    p.add_argument("--forms-out", metavar="FILE", default=None,
                   help="write the run's fastest forms as a table FASTCOMM_GGUF_FORMS serves (fastcomm.kquant.forms)")
    p.add_argument("--forms-from", metavar="JSON", default=None,
                   help="with --forms-out: the table of a run saved earlier (--json), without a GPU")
    p.add_argument("--compare", nargs=2, metavar=("BASE", "OTHER"), default=None,
                   help="two saved runs (--json) side by side: each product's forms, OTHER's us against BASE's")
    p.add_argument("--save-forms", action="store_true",
                   help="write the run's forms table where FASTCOMM_GGUF_FORMS=auto reads this machine's "
                        "(FASTCOMM_CACHE_DIR/kquant-forms/GPU.json): served from then on, on this GPU")
    args = p.parse_args(argv)
    try:
        if args.compare:
            base, other = (_read_run("--compare", f) for f in args.compare)
            if base.get("tp", 1) != other.get("tp", 1):
                raise _RunError(f"--compare: the runs are of TP {base.get('tp', 1)} and {other.get('tp', 1)} "
                                "(different shapes)")
            print(f"| op | tokens | form | {args.compare[0]} us | {args.compare[1]} us | ratio |")
            print("|---|---|---|---|---|---|")
            for row in compare(base["rows"], other["rows"]):
                note = "" if row["same_routing"] else " (other routing)"
                for f, (a, b, ratio) in row["forms"].items():
                    print(f"| {row['op']}{note} | {row['tokens']} | {f} | {a} | {b} | {ratio if ratio else '-'} |")
            return 0
        if args.forms_from:
            if not args.forms_out:
                raise _RunError("--forms-from needs --forms-out")
            from pathlib import Path

            from fastcomm.kquant import forms

            run = _read_run("--forms-from", args.forms_from, device=True)
            table = forms_table(run, f"bench/gguf_kernels.py at TP {run.get('tp', 1)}: {Path(args.forms_from).name}")
            forms.dump(table, args.forms_out)
            print(forms_summary(table))
            return 0
        if args.suggest:
            print(_settings(suggest(_read_run("--suggest", args.suggest)["rows"])))
            return 0
    except _RunError as e:
        print(f"gguf_kernels: error: {e}", file=sys.stderr)
        return 2
    import torch

    linears, moe = tp_shapes(args.tp)  # one rank's shapes (the names and layers a step runs are TP 1's)
    tokens = [int(t) for t in args.tokens.split(",")]
    rng = np.random.default_rng(0)
    rows = []
    for name, shards, cols, _ in linears:
        # A prefill's logits are only its requests' last positions': the LM head never sees a prefill's tokens.
        counts = [n for n in tokens if n <= MAX_DECODE] if name == "lm_head" else tokens
        rows += bench_linear(name, shards, cols, counts, rng)
        torch.cuda.empty_cache()
    rows += bench_moe(tokens, rng, moe)
    lim = kquant.limits(0)
    print(f"# {torch.cuda.get_device_name()}, one rank's shapes at TP {args.tp}: GPU us per call (CUDA graphs of "
          f"{CALLS_PER_GRAPH} calls, weights out of L2); launches planned for {lim.name}: {lim.sms} SMs, {lim.smem_per_block} bytes of "
          "shared memory a block")
    text, steps = report(rows, tokens)
    print(text)
    thresholds = suggest(rows)
    print(f"# suggested on this GPU: {_settings(thresholds)}")
    run = {"device": torch.cuda.get_device_name(), "tp": args.tp, "limits": dataclasses.asdict(kquant.limits(0)),
           "rows": rows, "per_step_ms": steps, "suggested": thresholds}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1)
    if args.forms_out or args.save_forms:
        from fastcomm.config import read
        from fastcomm.kquant import forms
        from fastcomm.measure import source_commit
        import os

        commit = source_commit(os.environ.get("FASTCOMM_COMMIT"))
        table = forms_table(run, f"python -m fastcomm_bench.gguf_kernels --tp {args.tp} --tokens {args.tokens}"
                                 + (f" at commit {commit}" if commit else ""))
        for path in [args.forms_out] if args.forms_out else []:
            forms.dump(table, path)
        if args.save_forms:
            path = forms.machine_path(read("FASTCOMM_CACHE_DIR"), table.device)
            path.parent.mkdir(parents=True, exist_ok=True)
            forms.dump(table, path)
            print(f"# forms table saved to {path}: FASTCOMM_GGUF_FORMS=auto serves it on {table.device}")
        print(forms_summary(table))
    return 0


def compare(base: list[dict], other: list[dict]) -> list[dict]:
    """Each decode product (op by short name, tokens) both runs timed: every form's GPU us in each and the ratio
    (other / base), and whether the two timed the same routing (a MoE's experts, where the rows say: runs of
    gguf_kernels before b05b432 timed 16 experts at --tp, from it 256). Same machine and call, as `ab` runs
    revisions, makes a ratio a change's saving."""
    def key(r):
        return op_name(r["op"]), r["tokens"]

    mine = {key(r): r for r in other if r["tokens"] <= MAX_DECODE}
    out = []
    for r in base:
        if r["tokens"] > MAX_DECODE or key(r) not in mine:
            continue
        o = mine[key(r)]
        forms = {}
        for f in sorted(set(_forms(r)) & set(_forms(o))):
            a, b = r[f"{f}_us"], o[f"{f}_us"]
            forms[f] = (a, b, round(b / a, 3) if a and b else None)
        out.append({"op": key(r)[0], "tokens": r["tokens"], "forms": forms,
                    "same_routing": r.get("experts", MOE[1]) == o.get("experts", MOE[1])})
    return out


class _RunError(Exception):
    """A saved run that cannot be read, or options that do not go together: one line, exit status 2."""


def _read_run(flag: str, path: str, device: bool = False) -> dict:
    """A run ``--json`` saved (its rows, tp and, where ``device``, the GPU that ran it), or _RunError naming
    ``flag`` and ``path``."""
    try:
        with open(path) as f:
            run = json.load(f)
    except (OSError, ValueError) as e:
        raise _RunError(f"{flag} {path}: {e}") from None
    if not (isinstance(run, dict) and isinstance(run.get("rows"), list) and (not device or "device" in run)):
        raise _RunError(f"{flag} {path}: not a gguf_kernels --json record (no {'device and ' if device else ''}rows)")
    return run


def forms_summary(table) -> str:
    """Where a forms table leaves the policy's rule: one line a product and token count."""
    lines = [f"# forms table for {table.device} ({table.source}): where it leaves the policy's form"]
    for e in table.entries:
        for n, us in enumerate(e.us, start=1):
            if us is not None and us[0] < us[1]:
                lines.append(f"#   {e.op} at {n} token(s): {e.forms[n - 1]} {us[0]} us against the policy's "
                             f"{us[1]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
