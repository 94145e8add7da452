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

from .gguf_kernels import linear_shapes


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fastcomm_bench.kquant_profile", description=__doc__.splitlines()[0])
    p.add_argument("--op", required=True, choices=sorted(["moe", *linear_shapes()]))
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--form", default=None, help="a form of kquant.FORMS_LINEAR / FORMS_MOE (default: the policy's)")
    p.add_argument("--calls", type=int, default=4)
    args = p.parse_args(argv)
    if not 1 <= args.tokens <= 8:
        p.error(f"--tokens {args.tokens}: the kernels serve 1-8")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    import numpy as np
    import torch

    from fastcomm import kquant

    from .gguf_kernels import linear_weight, moe_inputs, moe_weights, pdl_setting

    rng = np.random.default_rng(0)
    n = args.tokens
    if args.op == "moe":
        a13, a2, q13, q2 = moe_weights(rng)
        w13, w2 = torch.from_numpy(a13).cuda(), torch.from_numpy(a2).cuda()
        x, ids, wts = moe_inputs(n)
        run = lambda: kquant.moe(x, w13, w2, wts, ids, q13, q2, None, silu=True, form=args.form)  # noqa: E731
    else:
        shards, cols = linear_shapes()[args.op]
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
