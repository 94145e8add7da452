"""Which of the K-quant kernels gain from a dependent launch (FASTCOMM_GGUF_PDL; the evidence behind
kquant.dependent_launch): the grouped MoE at 1 and 8 tokens and two dense mma products at 8 tokens (o_proj,
dense gate_up), each timed as bench/gguf_kernels.py times (a CUDA graph of 16 calls, each after a one-element
add), with the dependent launch on for every kernel but those whose symbol holds one of a variant's names. It
overrides kquant.dependent_launch, so it measures every kernel, not the policy.

    python -m fastcomm_bench.pdl_scope OUT.json     # needs an sm_90+ GPU, torch, CuPy, gguf

Run 2026-12-02 (tenth session) at 5b9998d, results in bench/results/2026-12-02-h200x1-s10-pdl-scope.json.
"""
from __future__ import annotations

import json
import sys

MOE_VARIANTS = {"plain": ("fc_",), "all": (), "no_up": ("moe_mma_up",), "no_down": ("moe_mma_down",),
                "no_quantize": ("quantize",), "no_sum": ("moe_sum",), "only_quantize": ("moe_mma", "moe_sum")}
DENSE_VARIANTS = {"plain": ("fc_",), "all": (), "no_quantize": ("quantize",), "no_mma": ("kq_mma",)}


def main(argv=None) -> int:
    import gguf
    import numpy as np
    import torch

    from fastcomm_vllm.gguf import kquant as k

    from .glm5_gguf import make_tensor
    from .gguf_kernels import _graph_time_us

    out_path = (argv if argv is not None else sys.argv[1:])[0]
    skip: list[tuple[str, ...]] = [()]
    launch, decide = k._launch, {"on": True}

    def launch_with(device, kernel, dtype, grid, block, stream, args, variant="", smem=0, prefetches=False):
        decide["on"] = not any(s in kernel.symbol(dtype, variant) for s in skip[0])
        return launch(device, kernel, dtype, grid, block, stream, args, variant=variant, smem=smem)

    k._launch = launch_with
    k.dependent_launch = lambda major, allowed, prefetches: decide["on"] and major >= 9

    rng = np.random.default_rng(0)

    def blocks(qt, shape):
        s, _ = make_tensor(rng, gguf.GGMLQuantizationType[qt], shape)
        return torch.from_numpy(np.ascontiguousarray(s, np.uint8)).cuda()

    res: dict[str, list[float]] = {}
    experts, hidden, inter = 16, 6144, 2048
    w13s = [blocks("Q4_K", (experts, 2 * inter, hidden)) for _ in range(2)]
    w2s = [blocks("Q5_K", (experts, hidden, inter)) for _ in range(2)]
    for n in (1, 8):
        x = torch.randn(n, hidden, dtype=torch.bfloat16, device="cuda") * 0.1
        ids = torch.stack([torch.randperm(experts)[:8] for _ in range(n)]).to(torch.int32).cuda()
        wts = torch.rand(n, 8, device="cuda")
        for _ in range(2):
            for name, names in MOE_VARIANTS.items():
                skip[0] = names
                t = _graph_time_us([lambda a=a, b=b: k.moe(x, a, b, wts, ids, k.Q4_K, k.Q5_K, None, silu=True,
                                                           form="grouped") for a, b in zip(w13s, w2s)])
                res.setdefault(f"moe_grouped_{n}_{name}", []).append(round(t, 2))
                print(f"moe grouped n={n} {name}: {t:.2f}", flush=True)
    for label, qt, rows, cols in (("dense_gate_up", "Q4_K", 24576, 6144), ("o_proj", "Q4_K", 6144, 16384)):
        ws = [blocks(qt, (rows, cols)) for _ in range(2)]
        segs = k.plan_linear([int(gguf.GGMLQuantizationType[qt])], [(0, rows, ws[0].shape[1])], ws[0].shape[1], cols)
        x = torch.randn(8, cols, dtype=torch.bfloat16, device="cuda")
        for _ in range(2):
            for name, names in DENSE_VARIANTS.items():
                skip[0] = names
                t = _graph_time_us([lambda w=w: k.linear(x, w, segs, form="mma") for w in ws])
                res.setdefault(f"{label}_8_{name}", []).append(round(t, 2))
                print(f"{label} n=8 {name}: {t:.2f}", flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
