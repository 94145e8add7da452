"""Float comparison in units of the last place, shared by the GPU tests (core and vLLM)."""
import torch

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def ulp_diff(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|a - ref| per element in units of ref's last place: its dtype's spacing at |ref|, which below the
    normal range (and at zero) is the subnormal spacing."""
    info = torch.finfo(ref.dtype)
    r = ref.double()
    _, e = torch.frexp(r)
    spacing = torch.ldexp(torch.ones_like(r), (e - 1 - MANTISSA_BITS[ref.dtype]).to(torch.int32))
    spacing = torch.where(r == 0, torch.zeros_like(r), spacing).clamp_min(info.smallest_normal * info.eps)
    return (a.double() - r).abs() / spacing


def ulp_stats(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(largest difference in ulps of ref, share of elements equal bit for bit)."""
    return ulp_diff(a, ref).max().item(), (a == ref).double().mean().item()


def rmsnorm_ref(ar: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(out, residual_out) of the unfused path that the fused op replaces: the all-reduce result stored in
    its dtype (``ar``), then vLLM's native (fused_add_)rms_norm as torch.compile runs it: z in fp32, the
    variance over the unrounded z, one rounding at the end (inductor drops eager's rounding between the
    scale and the weight; tests/vllm/test_fusion_numerics.py pins that)."""
    z = ar.float() if residual is None else ar.float() + residual.float()
    var = z.pow(2).mean(-1, keepdim=True)
    return (z * torch.rsqrt(var + eps) * weight.float()).to(ar.dtype), z.to(ar.dtype)
