"""fastcomm's K-quant decode kernels (csrc/kquant.cu) on a GPU, against gguf-py's dequantized weights.

Activations are chosen so int8 chunk quantization represents them exactly (a scale times integers up to
127, exact in bf16 too): the kernels must then equal dequantized weights times x up to fp32 sums and the
output dtype's rounding. Random activations are held to the int8 activation error, and to the plugin's own
CUDA kernels where the plugin is installed. Also: multi-shard weights stored padded (read in place), MoE up
and down over (token, expert) pairs, NaN, and a CUDA graph replayed with inputs changed between replays; each for the staged (one-launch) forms and
the quantize-then-product forms.
Needs a GPU, torch, CuPy and gguf (not vLLM).
"""
import numpy as np
import pytest

from conftest import installed
from kquant_data import exact_activations, weights

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.skipif(not installed("gguf"), reason="needs gguf"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
    pytest.mark.skipif(not installed("cupy"), reason="needs CuPy (NVRTC)"),
]

TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
OUT_TOL = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-5}


def kq():
    from fastcomm_vllm.gguf import kquant

    return kquant


def check(got: torch.Tensor, want: np.ndarray, terms: np.ndarray, dtype) -> float:
    """|got - want| within the output dtype's rounding of want plus fp32 sums' error relative to the size of
    the terms summed (``terms`` = |x| @ |w|); returns the worst ratio to that bound."""
    diff = np.abs(got.float().cpu().numpy().astype(np.float64) - want)
    bound = OUT_TOL[dtype] * np.abs(want) + 2e-5 * terms + 1e-30
    assert np.isfinite(diff).all()
    worst = float((diff / bound).max())
    assert worst <= 1.0, worst
    return worst


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "two-launch"])
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_gemv_exact_activations(qtype, n, staged):
    k = kq()
    rng = np.random.default_rng(n)
    rows, cols = 37, 2048
    stored, truth = weights(qtype, (rows, cols), seed=11)
    x = exact_activations(rng, n, cols)
    w = torch.from_numpy(stored).cuda()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        xt = torch.from_numpy(x).to(dtype).cuda()
        got = k.linear(xt, w, (k.Segment(getattr(k, qtype), 0, rows),), staged=staged)
        want = x.astype(np.float64) @ truth.T
        check(got, want, np.abs(x) @ np.abs(truth).T, dtype)


@pytest.mark.parametrize("qtype", TYPES)
def test_gemv_random_activations_and_the_plugin(qtype):
    k = kq()
    rng = np.random.default_rng(5)
    rows, cols = 512, 6144
    stored, truth = weights(qtype, (rows, cols), seed=12)
    x = rng.standard_normal((4, cols)).astype(np.float32)
    w = torch.from_numpy(stored).cuda()
    xt = torch.from_numpy(x).to(torch.bfloat16).cuda()
    got = k.linear(xt, w, (k.Segment(getattr(k, qtype), 0, rows),)).float().cpu().numpy()
    want = xt.float().cpu().numpy().astype(np.float64) @ truth.T
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    if installed("vllm_gguf_plugin"):
        try:
            from vllm_gguf_plugin import ops
        except Exception:  # the plugin needs vLLM to import
            return
        if hasattr(torch.ops, "_C_gguf") and hasattr(torch.ops._C_gguf, "ggml_mul_mat_vec_a8"):
            theirs = ops.ggml_mul_mat_vec_a8(w, xt, getattr(k, qtype), rows).float().cpu().numpy()
            assert np.linalg.norm(got - theirs) / np.linalg.norm(theirs) < 1e-2


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "two-launch"])
def test_padded_shards_of_two_types_read_in_place(staged):
    """GLM-5's fused_qkv_a_proj as the plugin stores it: q_a (Q5_K) then kv_a (Q8_0) rows, zero-padded to the
    wider row; one launch, outputs side by side in shard order."""
    k = kq()
    rng = np.random.default_rng(7)
    cols = 6144
    qa, qa_t = weights("Q5_K", (64, cols), seed=13)
    kva, kva_t = weights("Q8_0", (24, cols), seed=14)
    width = max(qa.shape[1], kva.shape[1])
    padded = np.zeros((88, width), np.uint8)
    padded[:64, :qa.shape[1]] = qa
    padded[64:, :kva.shape[1]] = kva
    segs = k.plan_linear([k.Q5_K, k.Q8_0], [(0, 64, qa.shape[1]), (64, 88, kva.shape[1])], width, cols)
    assert segs is not None
    x = exact_activations(rng, 2, cols)
    got = k.linear(torch.from_numpy(x).cuda(), torch.from_numpy(padded).cuda(), segs, staged=staged)
    both = np.concatenate([qa_t, kva_t])
    check(got, x.astype(np.float64) @ both.T, np.abs(x) @ np.abs(both).T, torch.float32)


def _act(up: torch.Tensor) -> torch.Tensor:
    g, u = up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(up.dtype)


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "five-launch"])
@pytest.mark.parametrize("types", [("Q4_K", "Q5_K"), ("Q4_K", "Q6_K"), ("Q8_0", "Q8_0")])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_moe_up_and_down(types, tokens, staged):
    """Staged: silu(gate) * up inside the up kernel; five-launch: the same activation from torch between."""
    k = kq()
    rng = np.random.default_rng(tokens)
    experts, hidden, inter, topk = 6, 512, 256, 4
    w13, w13_t = weights(types[0], (experts, 2 * inter, hidden), seed=15)
    w2, w2_t = weights(types[1], (experts, hidden, inter), seed=16)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.permutation(experts)[:topk] for _ in range(tokens)]).astype(np.int32)
    wts = rng.random((tokens, topk)).astype(np.float32)
    xt = torch.from_numpy(x).cuda()
    got = k.moe(xt, torch.from_numpy(w13).cuda(), torch.from_numpy(w2).cuda(), torch.from_numpy(wts).cuda(),
                torch.from_numpy(ids).cuda(), getattr(k, types[0]), getattr(k, types[1]), _act, silu=True,
                staged=staged)
    want = np.zeros((tokens, hidden))
    for t in range(tokens):
        for j in range(topk):
            e = ids[t, j]
            up = torch.from_numpy(w13_t[e] @ x[t].astype(np.float64))
            g, u = up.chunk(2)
            a = (torch.nn.functional.silu(g) * u).numpy()
            want[t] += wts[t, j] * (w2_t[e] @ a)
    rel = np.linalg.norm(got.cpu().numpy() - want) / np.linalg.norm(want)
    assert rel < 3e-2, rel  # two int8 activation quantizations (x, then the activation) against float64
    # The same pipeline from the dense kernel (exact-activation tested above): the pairs' routing, the
    # activation rows' order and the router weights must agree to fp32 rounding.
    w13g, w2g = torch.from_numpy(w13).cuda(), torch.from_numpy(w2).cuda()
    same = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(topk):
            e = int(ids[t, j])
            up = k.linear(xt[t:t + 1], w13g[e], (k.Segment(getattr(k, types[0]), 0, 2 * inter),))
            down = k.linear(_act(up), w2g[e], (k.Segment(getattr(k, types[1]), 0, hidden),))
            same[t] += float(wts[t, j]) * down[0].double().cpu()
    close = torch.linalg.norm(got.cpu().double() - same) / torch.linalg.norm(same)
    assert close < 1e-5, float(close)


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "two-launch"])
def test_nan_propagates_and_zeros_stay_zero(staged):
    k = kq()
    stored, _ = weights("Q4_K", (8, 256), seed=17)
    w = torch.from_numpy(stored).cuda()
    x = torch.zeros(3, 256, device="cuda")
    x[1] = -0.0
    x[2, 5] = float("nan")
    got = k.linear(x, w, (k.Segment(k.Q4_K, 0, 8),), staged=staged).cpu()
    assert torch.all(got[:2] == 0)
    assert torch.all(torch.isnan(got[2]))


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "two-launch"])
def test_cuda_graph_replays_with_changing_inputs(staged):
    k = kq()
    rng = np.random.default_rng(9)
    rows, cols = 96, 2048
    stored, truth = weights("Q6_K", (rows, cols), seed=18)
    w = torch.from_numpy(stored).cuda()
    segs = (k.Segment(k.Q6_K, 0, rows),)
    x = torch.zeros(2, cols, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        k.linear(x, w, segs, staged=staged)  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = k.linear(x, w, segs, staged=staged)
    for i in range(2000):
        xi = exact_activations(rng, 2, cols)
        x.copy_(torch.from_numpy(xi))
        graph.replay()
        if i % 250 == 0 or i == 1999:
            check(out, xi.astype(np.float64) @ truth.T, np.abs(xi) @ np.abs(truth).T, torch.bfloat16)
