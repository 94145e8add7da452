"""A one-kernel add + RMSNorm (Triton), the 'separate norm' that the fused op is measured against.

Same rounding as vLLM's native fused_add_rms_norm once torch.compile has fused it (what vLLM serves), so the
unfused baseline is a fair single launch, not a chain of torch ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm(x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=m, other=0.0)
    r = tl.load(r_ptr + row * H + offs, mask=m, other=0.0)
    zf = x.to(tl.float32) + r.to(tl.float32)
    tl.store(rout_ptr + row * H + offs, zf.to(x.dtype), mask=m)
    inv = tl.rsqrt(tl.sum(zf * zf, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    o = zf * inv * w.to(tl.float32)
    tl.store(out_ptr + row * H + offs, o.to(x.dtype), mask=m)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                out: torch.Tensor, residual_out: torch.Tensor) -> None:
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    _add_rmsnorm[(rows,)](x, residual, weight, out, residual_out, hidden, eps,
                          BLOCK=triton.next_power_of_2(hidden), num_warps=8)
