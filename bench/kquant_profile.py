"""Run one GGUF decode product a few times, eagerly, for a profiler (ncu) to pick its kernels: the grouped MoE or
one of bench/gguf_kernels.py's linears at GLM-5's shapes and UD-Q4_K_XL types, in one form.

    python -m fastcomm_bench.kquant_profile --op moe --tokens 8 --form grouped [--calls 4]
    python -m fastcomm_bench.kquant_profile --op o_proj --tokens 8 --form mma

`bash bench/device_gguf.sh ncu DIR` runs it under ncu (the sections that say where a kernel's time goes).
Needs a GPU, torch, CuPy and gguf.
"""
from __future__ import annotations

import argparse
import sys

from .gguf_kernels import LINEARS, MOE


def _ops() -> dict[str, tuple]:
    return {"moe": MOE, **{name.split(" (")[0]: (name, shards, cols) for name, shards, cols, _ in LINEARS}}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fastcomm_bench.kquant_profile", description=__doc__.splitlines()[0])
    p.add_argument("--op", required=True, choices=sorted(_ops()))
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--form", default=None, help="a form of kquant.FORMS_LINEAR / FORMS_MOE (default: the policy's)")
    p.add_argument("--calls", type=int, default=4)
    args = p.parse_args(argv)
    if not 1 <= args.tokens <= 8:
        p.error(f"--tokens {args.tokens}: the kernels serve 1-8")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    import gguf
    import numpy as np
    import torch

    from fastcomm_vllm.gguf import kquant

    from .gguf_kernels import _blocks, linear_weight, pdl_setting

    rng = np.random.default_rng(0)
    n = args.tokens
    if args.op == "moe":
        _, experts, topk, hidden, inter, t13, t2, _ = MOE
        w13 = torch.from_numpy(_blocks(rng, t13, (experts, 2 * inter), hidden)).cuda()
        w2 = torch.from_numpy(_blocks(rng, t2, (experts, hidden), inter)).cuda()
        q13, q2 = int(gguf.GGMLQuantizationType[t13]), int(gguf.GGMLQuantizationType[t2])
        x = torch.randn(n, hidden, dtype=torch.bfloat16, device="cuda") * 0.1
        ids = torch.stack([torch.randperm(experts)[:topk] for _ in range(n)]).to(torch.int32).cuda()
        wts = torch.rand(n, topk, device="cuda")
        run = lambda: kquant.moe(x, w13, w2, wts, ids, q13, q2, None, silu=True, form=args.form)  # noqa: E731
    else:
        _, shards, cols = _ops()[args.op]
        padded, _, segs, _ = linear_weight(rng, shards, cols)
        w = torch.from_numpy(padded).cuda()
        x = torch.randn(n, cols, dtype=torch.bfloat16, device="cuda") * 0.1
        pdl = pdl_setting()
        run = lambda: kquant.linear(x, w, segs, form=args.form, pdl=pdl)  # noqa: E731
    for _ in range(args.calls):
        run()
    torch.cuda.synchronize()
    form = args.form or "the policy's"
    print(f"kquant_profile: {args.op} at {n} token(s), form {form}, {args.calls} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
