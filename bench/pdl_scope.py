"""Which of the K-quant kernels gain from a dependent launch (FASTCOMM_GGUF_PDL; the evidence behind
kquant.dependent_launch): the grouped MoE at 1 and 8 tokens and two dense mma products at 8 tokens (o_proj,
dense gate_up), each timed as bench/gguf_kernels.py times (a CUDA graph of 16 calls, each after a one-element
add), with the dependent launch on for every kernel but those whose symbol holds one of a variant's names. It
overrides kquant.dependent_launch, so it measures every kernel, not the policy.

    python -m fastcomm_bench.pdl_scope OUT.json     # needs an sm_90+ GPU, torch, CuPy, gguf

Run 2026-12-02 (run s10) at 5b9998d as a probe making the same measurements (shapes written out, not taken
from gguf_kernels); results in bench/results/2026-12-02-h200x1-s10-pdl-scope.json.
"""
from __future__ import annotations

import json
import sys

MOE_VARIANTS = {"plain": ("fc_",), "all": (), "no_up": ("moe_mma_up",), "no_down": ("moe_mma_down",),
                "no_quantize": ("quantize",), "no_sum": ("moe_sum",), "only_quantize": ("moe_mma", "moe_sum")}
DENSE_VARIANTS = {"plain": ("fc_",), "all": (), "no_quantize": ("quantize",), "no_mma": ("kq_mma",)}
DENSE_OPS = ("dense gate_up", "o_proj")  # bench/gguf_kernels.LINEARS' names, at their shapes and types


def main(argv=None) -> int:
    import numpy as np
    import torch

    from fastcomm_vllm.gguf import kquant as k

    from .gguf_kernels import _graph_time_us, linear_shapes, linear_weight, moe_inputs, moe_weights

    out_path = (argv if argv is not None else sys.argv[1:])[0]
    skip: list[tuple[str, ...]] = [()]
    launch, decide = k._launch, {"on": True}

    def launch_with(device, kernel, dtype, grid, block, stream, args, variant="", smem=0, **_):
        decide["on"] = not any(s in kernel.symbol(dtype, variant) for s in skip[0])
        return launch(device, kernel, dtype, grid, block, stream, args, variant=variant, smem=smem)

    k._launch = launch_with
    k.dependent_launch = lambda major, allowed, prefetches: decide["on"] and major >= 9

    rng = np.random.default_rng(0)
    res: dict[str, list[float]] = {}
    a13, a2, q13, q2 = moe_weights(rng)
    w13s = [torch.from_numpy(a13).cuda() for _ in range(2)]
    w2s = [torch.from_numpy(a2).cuda() for _ in range(2)]
    for n in (1, 8):
        x, ids, wts = moe_inputs(n)
        for _ in range(2):
            for name, names in MOE_VARIANTS.items():
                skip[0] = names
                t = _graph_time_us([lambda a=a, b=b: k.moe(x, a, b, wts, ids, q13, q2, None, silu=True,
                                                           form="grouped") for a, b in zip(w13s, w2s)])
                res.setdefault(f"moe_grouped_{n}_{name}", []).append(round(t, 2))
                print(f"moe grouped n={n} {name}: {t:.2f}", flush=True)
    for label in DENSE_OPS:
        shards, cols = linear_shapes()[label]
        padded, _, segs, _ = linear_weight(rng, shards, cols)
        ws = [torch.from_numpy(padded).cuda() for _ in range(2)]
        x = torch.randn(8, cols, dtype=torch.bfloat16, device="cuda")
        for _ in range(2):
            for name, names in DENSE_VARIANTS.items():
                skip[0] = names
                t = _graph_time_us([lambda w=w: k.linear(x, w, segs, form="mma") for w in ws])
                res.setdefault(f"{label.replace(' ', '_')}_8_{name}", []).append(round(t, 2))
                print(f"{label} n=8 {name}: {t:.2f}", flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
