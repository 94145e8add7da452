"""fastcomm's K-quant decode kernels (csrc/kquant/kquant.cu) on a GPU, against gguf-py's dequantized weights.

Activations are chosen so int8 chunk quantization represents them exactly (a scale times integers up to
127, exact in bf16 too): the kernels must then equal dequantized weights times x up to fp32 sums and the
output dtype's rounding. Random activations are held to the int8 activation error, and to the plugin's own
CUDA kernels where the plugin is installed. Also: multi-shard weights stored padded (read in place), the MoE
(grouped by expert on the tensor cores, and per (token, expert) pair) with repeated and out-of-range expert
ids, NaN, and CUDA graphs replayed with inputs (and routing) changed between replays; products past 8 tokens
in calls of 8 (linear_chunks; moe_chunks: the grouped forms up to their route table's pairs); the weights
dequantized (dequantize); each linear test for every form (mma, staged, unstaged: kquant.FORMS_LINEAR), each
MoE test for each (grouped, pairs, shared: kquant.FORMS_MOE).
Needs a GPU, torch, CuPy and gguf (not vLLM).
"""
import numpy as np
import pytest

from conftest import installed
from kquant_data import exact_activations, weights

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not installed("gguf"), reason="needs gguf"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
    pytest.mark.skipif(not installed("cupy"), reason="needs CuPy (NVRTC)"),
]

TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
OUT_TOL = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-5}


def kq():
    from fastcomm import kquant

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


def _captured(fn):
    """``fn`` run once outside a capture (its kernels compiled and loaded), then captured into a CUDA graph:
    (the graph, the output its replays write)."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.fixture(autouse=True, params=["device", "sm_120"])
def limits(request, monkeypatch):
    """Every test twice: with the GPU's own limits, and planning for an RTX PRO 6000's (188 SMs, 99 KB of shared
    memory a block: FASTCOMM_TEST_DEVICE_LIMITS), the kernels' launches held to that cap."""
    k = kq()
    if request.param == "device":
        monkeypatch.delenv("FASTCOMM_TEST_DEVICE_LIMITS", raising=False)
    else:
        monkeypatch.setenv("FASTCOMM_TEST_MODE", "1")
        monkeypatch.setenv("FASTCOMM_TEST_DEVICE_LIMITS", request.param)
    k.forget_limits()
    lim = k.limits(0)
    assert request.param == "device" or lim.smem_per_block == k.EMULATED[request.param].smem_per_block
    yield lim
    k.forget_limits()


LINEAR_FORMS = ("mma", "staged", "unstaged")
MOE_FORMS = ("grouped", "pairs", "shared", "staged")
PER_PAIR = ("pairs", "staged")  # no guard against an expert id outside [0, experts)


@pytest.mark.parametrize("form", LINEAR_FORMS)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_gemv_exact_activations(qtype, n, form):
    """37 rows: the mma form's last tile is partial; 2048 columns: 8 units over its 4 warps."""
    k = kq()
    assert set(LINEAR_FORMS) == set(k.FORMS_LINEAR)
    rng = np.random.default_rng(n)
    rows, cols = 37, 2048
    stored, truth = weights(qtype, (rows, cols), seed=11)
    x = exact_activations(rng, n, cols)
    w = torch.from_numpy(stored).cuda()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        xt = torch.from_numpy(x).to(dtype).cuda()
        got = k.linear(xt, w, (k.Segment(getattr(k, qtype), 0, rows),), form=form)
        want = x.astype(np.float64) @ truth.T
        check(got, want, np.abs(x) @ np.abs(truth).T, dtype)


@pytest.mark.parametrize("cols", [256, 768, 1280, 4352, 6144])
def test_mma_warp_splits(cols):
    """3 tiles of 1, 3, 5, 17 and 24 units: 1, 3, 5, 6 (3, 3, 3, 3, 3, 2 units) and 8 warps a tile
    (kquant.mma_warps), each summing its units and warp 0 adding the partials."""
    k = kq()
    rng = np.random.default_rng(cols)
    stored, truth = weights("Q5_K", (48, cols), seed=19)
    x = exact_activations(rng, 8, cols)
    got = k.linear(torch.from_numpy(x).cuda(), torch.from_numpy(stored).cuda(), (k.Segment(k.Q5_K, 0, 48),),
                   form="mma")
    check(got, x.astype(np.float64) @ truth.T, np.abs(x) @ np.abs(truth).T, torch.float32)


@pytest.mark.parametrize("warps", [1, 7])
@pytest.mark.parametrize("qtype", TYPES)
def test_mma_ring_wraps(qtype, warps, limits):
    """24 units a row through each warp's 3-stage ring: 24 units on one warp, or 4, 4, 4, 3, 3, 3, 3 on seven;
    Q6_K / Q8_0 units start 2-byte aligned, at every offset of their 16-byte spans in turn."""
    k = kq()
    rng = np.random.default_rng(23)
    rows, cols = 40, 6144
    stored, truth = weights(qtype, (rows, cols), seed=29)
    x = exact_activations(rng, 5, cols)
    args = (torch.from_numpy(x).cuda(), torch.from_numpy(stored).cuda(), (k.Segment(getattr(k, qtype), 0, rows),))
    need = k.mma_smem(warps, k.mma_ring_bytes([getattr(k, qtype)]))
    if need > limits.smem_per_block:  # seven warps' rings do not fit 99 KB: refused, not launched
        with pytest.raises(ValueError, match=f"needs {need} bytes of shared memory"):
            k.linear(*args, form="mma", warps=warps)
        return
    got = k.linear(*args, form="mma", warps=warps)
    check(got, x.astype(np.float64) @ truth.T, np.abs(x) @ np.abs(truth).T, torch.float32)


@pytest.mark.parametrize("qtype", TYPES)
def test_gemv_random_activations_and_the_plugin(qtype):
    """Every form against float64 and against each other, at 4 tokens (the policy's default form is one)."""
    k = kq()
    rng = np.random.default_rng(5)
    rows, cols = 512, 6144
    stored, truth = weights(qtype, (rows, cols), seed=12)
    x = rng.standard_normal((4, cols)).astype(np.float32)
    w = torch.from_numpy(stored).cuda()
    xt = torch.from_numpy(x).to(torch.bfloat16).cuda()
    want = xt.float().cpu().numpy().astype(np.float64) @ truth.T
    forms = {f: k.linear(xt, w, (k.Segment(getattr(k, qtype), 0, rows),), form=f).float().cpu().numpy()
             for f in LINEAR_FORMS}
    for f, out in forms.items():
        assert np.linalg.norm(out - want) / np.linalg.norm(want) < 1e-2, f
        # the same int8 activations and integer dots: only fp32 summation order and the bf16 output differ
        assert np.linalg.norm(out - forms["staged"]) / np.linalg.norm(want) < 4e-3, f
    got = k.linear(xt, w, (k.Segment(getattr(k, qtype), 0, rows),)).float().cpu().numpy()
    if installed("vllm_gguf_plugin"):
        try:
            from vllm_gguf_plugin import ops
        except Exception:  # the plugin needs vLLM to import
            return
        if hasattr(torch.ops, "_C_gguf") and hasattr(torch.ops._C_gguf, "ggml_mul_mat_vec_a8"):
            theirs = ops.ggml_mul_mat_vec_a8(w, xt, getattr(k, qtype), rows).float().cpu().numpy()
            assert np.linalg.norm(got - theirs) / np.linalg.norm(theirs) < 1e-2


def _fused_qkv_a(rows_a: int, rows_b: int, cols: int, seed: int):
    """GLM-5's fused_qkv_a_proj as the plugin stores it: ``rows_a`` q_a rows (Q5_K) then ``rows_b`` kv_a rows
    (Q8_0), zero-padded to the wider row. (The padded uint8 weight, the two shards as stored, their float64
    truth one under the other.)"""
    qa, qa_t = weights("Q5_K", (rows_a, cols), seed=seed)
    kva, kva_t = weights("Q8_0", (rows_b, cols), seed=seed + 1)
    padded = np.zeros((rows_a + rows_b, max(qa.shape[1], kva.shape[1])), np.uint8)
    padded[:rows_a, :qa.shape[1]], padded[rows_a:, :kva.shape[1]] = qa, kva
    return padded, (qa, kva), np.concatenate([qa_t, kva_t])


@pytest.mark.parametrize("form", LINEAR_FORMS)
def test_padded_shards_of_two_types_read_in_place(form):
    """GLM-5's fused_qkv_a_proj as the plugin stores it: q_a (Q5_K) then kv_a (Q8_0) rows, zero-padded to the
    wider row; one launch, outputs side by side in shard order."""
    k = kq()
    rng = np.random.default_rng(7)
    cols = 6144
    padded, (qa, kva), both = _fused_qkv_a(64, 24, cols, seed=13)
    segs = k.plan_linear([k.Q5_K, k.Q8_0], [(0, 64, qa.shape[1]), (64, 88, kva.shape[1])], padded.shape[1], cols)
    assert segs is not None
    x = exact_activations(rng, 2, cols)
    got = k.linear(torch.from_numpy(x).cuda(), torch.from_numpy(padded).cuda(), segs, form=form)
    check(got, x.astype(np.float64) @ both.T, np.abs(x) @ np.abs(both).T, torch.float32)


def _act(up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up as the kernels' fused activation rounds it (and vLLM's silu_and_mul): silu, then the
    product, each in the dtype."""
    g, u = up.float().chunk(2, dim=-1)
    s = (g / (1 + torch.exp(-g))).to(up.dtype).float()
    return (s * u).to(up.dtype)


def _experts(t13: str, t2: str, experts: int, hidden: int, inter: int, seed: int):
    """A MoE layer's experts as the plugin stores them: w13 [experts, 2 inter, row] of ``t13`` and w2 [experts,
    hidden, row] of ``t2`` (seeds ``seed`` and ``seed + 1``), with their float64 truths: (w13, w13_t, w2, w2_t)."""
    w13, w13_t = weights(t13, (experts, 2 * inter, hidden), seed=seed)
    w2, w2_t = weights(t2, (experts, hidden, inter), seed=seed + 1)
    return w13, w13_t, w2, w2_t


def _moe_reference(x, ids, wts, w13_t, w2_t, experts):
    """float64, pair by pair; a pair routed outside [0, experts) adds nothing."""
    want = np.zeros((x.shape[0], w2_t.shape[1]))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if not 0 <= e < experts:
                continue
            g, u = np.split(w13_t[e] @ x[t].astype(np.float64), 2)
            want[t] += wts[t, j] * (w2_t[e] @ (g / (1 + np.exp(-g)) * u))
    return want


@pytest.mark.parametrize("form", MOE_FORMS)
@pytest.mark.parametrize("types", [("Q4_K", "Q5_K"), ("Q4_K", "Q6_K"), ("Q8_0", "Q8_0")])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_moe_up_and_down(types, tokens, form):
    k = kq()
    assert set(MOE_FORMS) == set(k.FORMS_MOE)
    rng = np.random.default_rng(tokens)
    experts, hidden, inter, topk = 6, 512, 256, 4
    w13, w13_t, w2, w2_t = _experts(types[0], types[1], experts, hidden, inter, seed=15)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.permutation(experts)[:topk] for _ in range(tokens)]).astype(np.int32)
    wts = rng.random((tokens, topk)).astype(np.float32)
    xt = torch.from_numpy(x).cuda()
    got = k.moe(xt, torch.from_numpy(w13).cuda(), torch.from_numpy(w2).cuda(), torch.from_numpy(wts).cuda(),
                torch.from_numpy(ids).cuda(), getattr(k, types[0]), getattr(k, types[1]), _act, silu=True,
                form=form)
    want = _moe_reference(x, ids, wts, w13_t, w2_t, experts)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("types,hidden,inter", [(("Q4_K", "Q5_K"), 512, 256), (("Q5_K", "Q6_K"), 768, 512),
                                                (("Q8_0", "Q8_0"), 96, 160)])
@pytest.mark.parametrize("tokens", [1, 2, 3, 8])
def test_moe_staged_equals_pairs_bit_for_bit(tokens, types, hidden, inter, dtype):
    """The staged form quantizes its activations in each block (down: silu(gate) * up while staging) and then
    multiplies chunk for chunk as the pairs form does: the same bits, with the fused silu and with the caller's
    activation, in every dtype; Q8_0 at 96 x 160 columns (3 and 5 chunks: a row that is no multiple of a warp's
    32 chunks). Then a captured graph replayed with new tokens and routes still equals the pairs form."""
    k = kq()
    rng = np.random.default_rng(60 + tokens)
    experts, topk = 16, 4
    w13, _, w2, _ = _experts(types[0], types[1], experts, hidden, inter, seed=61)
    w13g, w2g = torch.from_numpy(w13).cuda(), torch.from_numpy(w2).cuda()
    t13, t2 = getattr(k, types[0]), getattr(k, types[1])
    x = torch.zeros(tokens, hidden, dtype=dtype, device="cuda")
    ids = torch.zeros(tokens, topk, dtype=torch.int32, device="cuda")
    wts = torch.zeros(tokens, topk, device="cuda")

    def new_inputs():
        x.copy_(torch.from_numpy(rng.standard_normal((tokens, hidden)).astype(np.float32)))
        ids.copy_(torch.from_numpy(np.stack([rng.choice(experts, topk) for _ in range(tokens)]).astype(np.int32)))
        wts.copy_(torch.from_numpy(rng.random((tokens, topk)).astype(np.float32)))

    new_inputs()
    for silu in (True, False):
        pairs = k.moe(x, w13g, w2g, wts, ids, t13, t2, _act, silu=silu, form="pairs")
        staged = k.moe(x, w13g, w2g, wts, ids, t13, t2, _act, silu=silu, form="staged")
        assert staged.dtype == dtype and torch.isfinite(pairs).all() and pairs.abs().sum() > 0
        assert torch.equal(staged, pairs), silu
    graph, out = _captured(lambda: k.moe(x, w13g, w2g, wts, ids, t13, t2, _act, silu=True, form="staged"))
    for i in range(50):
        new_inputs()
        graph.replay()
        assert torch.equal(out, k.moe(x, w13g, w2g, wts, ids, t13, t2, _act, silu=True, form="pairs")), i


def test_moe_staged_past_the_shared_memory_says_so_and_the_policy_keeps_pairs(limits):
    """A stage larger than a block's shared memory (64 pairs of 2048 values: 160 KB; the H200's 227 KB holds it,
    sm_120's 99 KB does not): asked for, the staged form raises naming shared memory; ``staged=True`` without a
    form then runs pairs, with the same sums as asked-for pairs."""
    k = kq()
    rng = np.random.default_rng(70)
    experts, hidden, inter, topk, tokens = 8, 256, 2048, 8, 8
    w13, _, w2, _ = _experts("Q4_K", "Q4_K", experts, hidden, inter, seed=71)
    args = (torch.from_numpy(rng.standard_normal((tokens, hidden)).astype(np.float32)).cuda(),
            torch.from_numpy(w13).cuda(), torch.from_numpy(w2).cuda(),
            torch.from_numpy(rng.random((tokens, topk)).astype(np.float32)).cuda(),
            torch.from_numpy(np.stack([rng.permutation(experts) for _ in range(tokens)]).astype(np.int32)).cuda(),
            k.Q4_K, k.Q4_K, _act)
    if k.moe_stage_bytes(tokens, topk, hidden, inter) <= limits.smem_per_block:
        pytest.skip(f"{limits.name} holds the 160 KB stage")
    with pytest.raises(ValueError, match="staged MoE form needs 163840 bytes of shared memory"):
        k.moe(*args, silu=True, form="staged")
    chosen = k.moe(*args, silu=True, tensor_cores=False, staged=True)
    assert torch.equal(chosen, k.moe(*args, silu=True, form="pairs"))


@pytest.mark.parametrize("form", MOE_FORMS)
def test_moe_bf16_and_the_activation_hook(form):
    """bf16, and an activation other than silu handed over by the caller (the unfused path)."""
    k = kq()
    rng = np.random.default_rng(21)
    experts, hidden, inter, topk, tokens = 8, 768, 512, 3, 5
    w13, w13_t, w2, w2_t = _experts("Q4_K", "Q6_K", experts, hidden, inter, seed=22)
    x = (rng.standard_normal((tokens, hidden)) * 0.5).astype(np.float32)
    ids = np.stack([rng.permutation(experts)[:topk] for _ in range(tokens)]).astype(np.int32)
    wts = rng.random((tokens, topk)).astype(np.float32)
    args = (torch.from_numpy(x).to(torch.bfloat16).cuda(), torch.from_numpy(w13).cuda(), torch.from_numpy(w2).cuda(),
            torch.from_numpy(wts).cuda(), torch.from_numpy(ids).cuda(), k.Q4_K, k.Q6_K)
    fused = k.moe(*args, _act, silu=True, form=form)
    hooked = k.moe(*args, _act, silu=False, form=form)
    assert fused.dtype == torch.bfloat16
    # the fused silu quantize and the caller's activation then quantize: the same roundings (an exp's last bit
    # may differ, so an int8 activation may too)
    assert float((fused.float() - hooked.float()).norm() / hooked.float().norm()) < 2e-3
    want = _moe_reference(x, ids, wts, w13_t, w2_t, experts)
    assert np.linalg.norm(fused.float().cpu().numpy() - want) / np.linalg.norm(want) < 3e-2


@pytest.mark.parametrize("experts", [4, 64])
@pytest.mark.parametrize("form", MOE_FORMS)
def test_moe_repeated_and_foreign_expert_ids(form, experts):
    """A token routed twice to one expert (16 pairs on expert 0 at 8 tokens: two passes of the grouped tile)
    counts twice; for the grouped forms (grouped, shared), an id outside [0, experts) (expert parallelism's "not
    here") adds nothing. The pairs form has no such guard and is not given one: vLLM's router gives these kernels
    neither at tensor parallelism (the GGUF MoE does not run expert parallel). At 64 experts the 24 pairs are
    fewer than the experts, so the grouped launch's rows are a pair each (kq_mma_moe), an expert's first pair's
    row serving it."""
    k = kq()
    rng = np.random.default_rng(24)
    hidden, inter, topk, tokens = 512, 256, 3, 8
    w13, w13_t, w2, w2_t = _experts("Q4_K", "Q5_K", experts, hidden, inter, seed=25)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = np.zeros((tokens, topk), np.int32)
    ids[:, 2] = rng.integers(1, experts, size=tokens)
    if form not in PER_PAIR:
        ids[3, 2] = -1
        ids[5, 2] = experts
    wts = rng.random((tokens, topk)).astype(np.float32)
    got = k.moe(torch.from_numpy(x).cuda(), torch.from_numpy(w13).cuda(), torch.from_numpy(w2).cuda(),
                torch.from_numpy(wts).cuda(), torch.from_numpy(ids).cuda(), k.Q4_K, k.Q5_K, _act, silu=True,
                form=form)
    want = _moe_reference(x, ids, wts, w13_t, w2_t, experts)
    assert np.linalg.norm(got.cpu().numpy() - want) / np.linalg.norm(want) < 3e-2


@pytest.mark.parametrize("experts,topk", [(8, 2), (256, 8)])
def test_moe_graph_replays_with_new_routing(experts, topk):
    """The grouped form routes on the device: a captured graph replayed with new tokens and new expert ids
    (tokens moving between experts, experts left empty) stays right. 256 experts, top 8 (GLM-5's) at 4 tokens:
    fewer pairs than experts, a row of blocks a pair."""
    k = kq()
    rng = np.random.default_rng(27)
    hidden, inter, tokens = 512, 256, 4
    w13, w13_t, w2, w2_t = _experts("Q4_K", "Q5_K", experts, hidden, inter, seed=28)
    x = torch.zeros(tokens, hidden, device="cuda")
    ids = torch.zeros(tokens, topk, dtype=torch.int32, device="cuda")
    wts = torch.zeros(tokens, topk, device="cuda")
    w13g, w2g = torch.from_numpy(w13).cuda(), torch.from_numpy(w2).cuda()
    run = lambda: k.moe(x, w13g, w2g, wts, ids, k.Q4_K, k.Q5_K, _act, silu=True, form="grouped")  # noqa: E731
    graph, out = _captured(run)
    for i in range(200):
        xi = rng.standard_normal((tokens, hidden)).astype(np.float32)
        idi = np.stack([rng.permutation(experts if i % 2 else topk + 1)[:topk]
                        for _ in range(tokens)]).astype(np.int32)
        wi = rng.random((tokens, topk)).astype(np.float32)
        x.copy_(torch.from_numpy(xi))
        ids.copy_(torch.from_numpy(idi))
        wts.copy_(torch.from_numpy(wi))
        graph.replay()
        if i % 20 == 0 or i == 199:
            want = _moe_reference(xi, idi, wi, w13_t, w2_t, experts)
            assert np.linalg.norm(out.cpu().numpy() - want) / np.linalg.norm(want) < 3e-2, i


@pytest.mark.parametrize("form", LINEAR_FORMS)
def test_nan_propagates_and_zeros_stay_zero(form):
    k = kq()
    stored, _ = weights("Q4_K", (8, 256), seed=17)
    w = torch.from_numpy(stored).cuda()
    x = torch.zeros(4, 256, device="cuda")
    x[1] = -0.0
    x[2, 5] = float("nan")
    x[3] = 1.0
    got = k.linear(x, w, (k.Segment(k.Q4_K, 0, 8),), form=form).cpu()
    assert torch.all(got[:2] == 0)
    assert torch.all(torch.isnan(got[2]))
    assert torch.all(torch.isfinite(got[3]))  # the mma form shares fragments between vectors: NaN stays in its own


@pytest.mark.parametrize("form", LINEAR_FORMS)
def test_cuda_graph_replays_with_changing_inputs(form):
    k = kq()
    rng = np.random.default_rng(9)
    rows, cols = 96, 2048
    stored, truth = weights("Q6_K", (rows, cols), seed=18)
    w = torch.from_numpy(stored).cuda()
    segs = (k.Segment(k.Q6_K, 0, rows),)
    x = torch.zeros(2, cols, dtype=torch.bfloat16, device="cuda")
    graph, out = _captured(lambda: k.linear(x, w, segs, form=form))
    for i in range(2000):
        xi = exact_activations(rng, 2, cols)
        x.copy_(torch.from_numpy(xi))
        graph.replay()
        if i % 250 == 0 or i == 1999:
            check(out, xi.astype(np.float64) @ truth.T, np.abs(xi) @ np.abs(truth).T, torch.bfloat16)


@pytest.mark.parametrize("form", LINEAR_FORMS)
def test_back_to_back_products_wait_for_each_other(form):
    """Dependent launches (FASTCOMM_GGUF_PDL, sm_90+; the dense mma form's kernel, kquant.dependent_launch): a
    MoE, then a product of its output, then a product of that, each mma product's kernel starting while the
    quantize before it runs and fetching weights before it waits for it. The chain (eager, and a CUDA graph
    replayed with new inputs and routes) is bitwise equal to the same chain launched plainly (every form: the
    dp4a ones run beside it as a control)."""
    k = kq()
    if not k.dependent_launch(k.limits(0).major, True, True):
        pytest.skip("no dependent launch on this GPU (sm_90+)")
    rng = np.random.default_rng(31)
    experts, hidden, inter, topk, tokens = 8, 512, 256, 2, 5
    w13, _ = weights("Q4_K", (experts, 2 * inter, hidden), seed=32)
    w2, _ = weights("Q5_K", (experts, hidden, inter), seed=33)
    wa, _ = weights("Q4_K", (4096, hidden), seed=34)
    wb, _ = weights("Q6_K", (40, 4096), seed=35)
    w13g, w2g, wag, wbg = (torch.from_numpy(a).cuda() for a in (w13, w2, wa, wb))
    sa, sb = (k.Segment(k.Q4_K, 0, 4096),), (k.Segment(k.Q6_K, 0, 40),)
    moe_form = "grouped" if form == "mma" else "pairs"
    x = torch.zeros(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(tokens, topk, dtype=torch.int32, device="cuda")
    wts = torch.zeros(tokens, topk, device="cuda")

    def chain(pdl=True):
        y = k.moe(x, w13g, w2g, wts, ids, k.Q4_K, k.Q5_K, _act, silu=True, form=moe_form)
        return k.linear(k.linear(y, wag, sa, form=form, pdl=pdl), wbg, sb, form=form, pdl=pdl)

    def plain():
        return chain(pdl=False).clone()

    def new_inputs(i):
        x.copy_(torch.from_numpy(rng.standard_normal((tokens, hidden)).astype(np.float32)))
        ids.copy_(torch.from_numpy(np.stack([rng.permutation(experts if i % 2 else 3)[:topk]
                                             for _ in range(tokens)]).astype(np.int32)))
        wts.copy_(torch.from_numpy(rng.random((tokens, topk)).astype(np.float32)))

    for i in range(20):
        new_inputs(i)
        got = chain()
        assert torch.equal(got, plain()), i
    graph, out = _captured(chain)
    for i in range(300):
        new_inputs(i)
        graph.replay()
        if i % 30 == 0 or i == 299:
            assert torch.equal(out, plain()), i


@pytest.mark.parametrize("form", LINEAR_FORMS)
def test_a_weight_off_16_byte_alignment_is_refused(form):
    """Every form reads Q4_K rows by 16 bytes: a weight viewed 8 bytes into its storage faulted the kernels
    (2026-12-02 run s10); it is refused with its address named, and the vLLM wiring sends it to the plugin."""
    k = kq()
    rows, cols = 32, 512
    stored, _ = weights("Q4_K", (rows, cols), seed=41)
    flat = torch.zeros(stored.size + 8, dtype=torch.uint8, device="cuda")
    w = flat[8:].view(rows, -1)
    x = torch.zeros(4, cols, device="cuda")
    with pytest.raises(ValueError, match="16-byte aligned"):
        k.linear(x, w, (k.Segment(k.Q4_K, 0, rows),), form=form)


def _plugin_ops():
    """The plugin's ops where it imports (it needs vLLM), else skip: the prefill's dequantized forms run its
    ggml_dequantize (and vLLM's fused_experts)."""
    if not installed("vllm_gguf_plugin"):
        pytest.skip("needs vllm-gguf-plugin")
    try:
        from vllm_gguf_plugin import ops
    except Exception as e:  # the plugin needs vLLM to import
        pytest.skip(f"vllm-gguf-plugin does not import here: {e}")
    return ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_is_gguf_py_s_rounded_once(dtype):
    """fastcomm's dequantize (fc_kq_dequant) of fused_qkv_a as the plugin stores it (Q5_K rows, then Q8_0 rows
    padded to the wider row, read in place) and of a Q4_K / Q6_K expert stack: every weight equals gguf-py's
    dequantized weight rounded to the dtype (fp32: to the bit)."""
    k = kq()
    cols = 2048
    padded, _, truth = _fused_qkv_a(40, 24, cols, seed=51)
    segs = (k.Segment(k.Q5_K, 0, 40), k.Segment(k.Q8_0, 40, 24))
    got = k.dequantize(torch.from_numpy(padded).cuda(), segs, cols, dtype)
    want = torch.from_numpy(truth.astype(np.float32)).to(dtype).cuda()
    assert got.dtype == dtype and torch.equal(got, want)
    for qtype in ("Q4_K", "Q6_K"):
        stack, stack_t = weights(qtype, (3, 32, 512), seed=53)  # 3 experts of 32 rows, as w13 / w2 are stored
        flat = torch.from_numpy(stack).cuda().reshape(96, -1)
        got = k.dequantize(flat, (k.Segment(getattr(k, qtype), 0, 96),), 512, dtype).view(3, 32, 512)
        assert torch.equal(got, torch.from_numpy(stack_t.astype(np.float32)).to(dtype).cuda()), qtype


@pytest.mark.parametrize("kernel", ["plugin", "fastcomm"])
def test_prefill_dequant_linear_of_two_padded_types(kernel):
    """The prefill's dequantized form (kquant_vllm.dequant_linear) of fused_qkv_a as the plugin stores it (Q5_K
    rows, then Q8_0 rows padded to the wider row), 64 tokens, the weights written by either dequantizer: equal to
    float64 up to the bf16 weights' and output's rounding, and to the plugin's own MMQ path."""
    ops = _plugin_ops()
    from fastcomm_vllm.gguf import kquant_vllm

    k = kq()
    rng = np.random.default_rng(8)
    cols = 2048
    padded, (qa, kva), truth = _fused_qkv_a(64, 24, cols, seed=21)
    x = torch.from_numpy(rng.standard_normal((64, cols)).astype(np.float32)).to(torch.bfloat16).cuda()
    w = torch.from_numpy(padded).cuda()
    got = kquant_vllm.dequant_linear(x, w, [k.Q5_K, k.Q8_0], [0, 64], [64, 24], kernel=kernel).float().cpu().numpy()
    want = x.float().cpu().numpy().astype(np.float64) @ truth.T
    assert got.shape == (64, 88)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    theirs = torch.cat([ops.ggml_mul_mat_a8(torch.from_numpy(qa).cuda(), x, k.Q5_K, 64),
                        ops.ggml_mul_mat_a8(torch.from_numpy(kva).cuda(), x, k.Q8_0, 24)], dim=1)
    theirs = theirs.float().cpu().numpy()
    assert np.linalg.norm(got - theirs) / np.linalg.norm(theirs) < 2e-2


@pytest.mark.parametrize("kernel", ["plugin", "fastcomm"])
def test_prefill_dequant_moe(kernel):
    """The prefill's dequantized MoE form (kquant_vllm.dequant_moe: every expert dequantized by either
    dequantizer, vLLM's fused_experts), 64 tokens with an expert no token routes to: against float64 pair by
    pair."""
    _plugin_ops()
    from fastcomm_vllm.gguf import kquant_vllm

    k = kq()
    rng = np.random.default_rng(9)
    experts, hidden, inter, topk, tokens = 6, 512, 256, 4, 64
    w13, w13_t, w2, w2_t = _experts("Q4_K", "Q5_K", experts, hidden, inter, seed=23)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.permutation(experts - 1)[:topk] for _ in range(tokens)]).astype(np.int32)
    wts = rng.random((tokens, topk)).astype(np.float32)
    xt = torch.from_numpy(x).to(torch.bfloat16).cuda()
    got = kquant_vllm.dequant_moe(xt, torch.from_numpy(w13).cuda(), torch.from_numpy(w2).cuda(),
                                  torch.from_numpy(wts).cuda(), torch.from_numpy(ids).cuda(), k.Q4_K, k.Q5_K, "silu",
                                  kernel=kernel)
    want = _moe_reference(xt.float().cpu().numpy(), ids, wts, w13_t, w2_t, experts)
    rel = np.linalg.norm(got.float().cpu().numpy() - want) / np.linalg.norm(want)
    assert rel < 2e-2, rel  # bf16 weights, activations and output against float64


@pytest.mark.parametrize("warps", [1, 2, 8])
def test_moe_shared_form_at_every_block_size(warps):
    """The shared form at the block sizes the benchmark times beside its default (4 warps, every MoE test above):
    the same sums as the grouped form's, up to fp32 summation order (its tiles' units are not split over warps)."""
    k = kq()
    rng = np.random.default_rng(31)
    experts, hidden, inter, topk, tokens = 6, 512, 256, 4, 8
    w13 = torch.from_numpy(weights("Q4_K", (experts, 2 * inter, hidden), seed=32)[0]).cuda()
    w2 = torch.from_numpy(weights("Q5_K", (experts, hidden, inter), seed=33)[0]).cuda()
    x = torch.from_numpy(rng.standard_normal((tokens, hidden)).astype(np.float32)).cuda()
    ids = torch.from_numpy(np.stack([rng.permutation(experts)[:topk] for _ in range(tokens)]).astype(np.int32)).cuda()
    wts = torch.from_numpy(rng.random((tokens, topk)).astype(np.float32)).cuda()
    got = k.moe(x, w13, w2, wts, ids, k.Q4_K, k.Q5_K, _act, silu=True, form="shared", shared_warps=warps)
    want = k.moe(x, w13, w2, wts, ids, k.Q4_K, k.Q5_K, _act, silu=True, form="grouped")
    assert float(torch.linalg.norm(got - want) / torch.linalg.norm(want)) < 1e-5


@pytest.mark.parametrize("form", LINEAR_FORMS)
@pytest.mark.parametrize("n", [9, 19, 64])
def test_linear_chunks_of_any_count_read_in_place(n, form):
    """A product past 8 tokens 8 at a time (kquant.linear_chunks, FASTCOMM_GGUF_CHUNK_MAX_TOKENS): fused_qkv_a's
    two padded types, exact activations; every row equal to float64 as a decode call's (a chunk written to the
    wrong rows, or a short last chunk dropped, shows here)."""
    k = kq()
    rng = np.random.default_rng(40 + n)
    cols = 2048
    # q_a's rows end on a 16-row tile, as GLM-5's 2048 do: the mma form reads a tile from one segment only
    padded, _, truth = _fused_qkv_a(48, 24, cols, seed=41)
    segs = (k.Segment(k.Q5_K, 0, 48), k.Segment(k.Q8_0, 48, 24))
    x = exact_activations(rng, n, cols)
    w = torch.from_numpy(padded).cuda()
    for dtype in (torch.bfloat16, torch.float32):
        got = k.linear_chunks(torch.from_numpy(x).to(dtype).cuda(), w, segs, form=form)
        assert got.shape == (n, 72)
        check(got, x.astype(np.float64) @ truth.T, np.abs(x) @ np.abs(truth).T, dtype)


@pytest.mark.parametrize("form", MOE_FORMS)
def test_moe_chunks_of_any_count(form):
    """The routed experts of 70 tokens of top 4 (kquant.moe_chunks: the grouped forms 64 tokens a call, their
    route table's 256 pairs, then 6; the pairs form 8 a call), for the grouped forms a foreign id among the
    routes (as test_moe_repeated_and_foreign_expert_ids): against float64 pair by pair, and each call's rows as
    ``moe`` on those tokens alone gives them (a call written to the wrong rows shows here)."""
    k = kq()
    rng = np.random.default_rng(43)
    experts, hidden, inter, topk, tokens = 6, 512, 256, 4, 70
    w13, w13_t, w2, w2_t = _experts("Q4_K", "Q5_K", experts, hidden, inter, seed=44)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.permutation(experts)[:topk] for _ in range(tokens)]).astype(np.int32)
    if form not in PER_PAIR:
        ids[5, 2] = experts + 3  # routed to another rank's expert: adds nothing
    wts = rng.random((tokens, topk)).astype(np.float32)
    xt, w13g, w2g = torch.from_numpy(x).cuda(), torch.from_numpy(w13).cuda(), torch.from_numpy(w2).cuda()
    idg, wtg = torch.from_numpy(ids).cuda(), torch.from_numpy(wts).cuda()
    got = k.moe_chunks(xt, w13g, w2g, wtg, idg, k.Q4_K, k.Q5_K, _act, silu=True, form=form)
    want = _moe_reference(x, ids, wts, w13_t, w2_t, experts)
    rel = np.linalg.norm(got.cpu().numpy() - want) / np.linalg.norm(want)
    assert rel < 3e-2, rel
    calls = k.chunk_rows(tokens, k.moe_call_tokens(topk, hidden, inter, form))
    assert len(calls) == (2 if form not in PER_PAIR else 9)
    for a, b in calls:
        alone = k.moe(xt[a:b].clone(), w13g, w2g, wtg[a:b].clone(), idg[a:b].clone(), k.Q4_K, k.Q5_K, _act,
                      silu=True, form=form)
        assert torch.equal(got[a:b], alone)


@pytest.mark.parametrize("form", ["grouped", "shared"])
def test_moe_grouped_forms_at_their_route_tables_limit(form):
    """32 tokens of top 8, the 256 pairs a grouped launch routes (16 experts: 16 pairs an expert on average,
    two or more passes of a tile), bf16: against float64, and against 8-token calls of the same form."""
    k = kq()
    rng = np.random.default_rng(48)
    experts, hidden, inter, topk = 16, 512, 256, 8
    tokens = k.abi.KQ_MAX_PAIRS // topk
    w13, w13_t, w2, w2_t = _experts("Q4_K", "Q6_K", experts, hidden, inter, seed=49)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = np.stack([rng.permutation(experts)[:topk] for _ in range(tokens)]).astype(np.int32)
    wts = rng.random((tokens, topk)).astype(np.float32)
    xt = torch.from_numpy(x).to(torch.bfloat16).cuda()
    w13g, w2g = torch.from_numpy(w13).cuda(), torch.from_numpy(w2).cuda()
    idg, wtg = torch.from_numpy(ids).cuda(), torch.from_numpy(wts).cuda()
    got = k.moe(xt, w13g, w2g, wtg, idg, k.Q4_K, k.Q6_K, _act, silu=True, form=form)
    want = _moe_reference(xt.float().cpu().numpy(), ids, wts, w13_t, w2_t, experts)
    assert np.linalg.norm(got.float().cpu().numpy() - want) / np.linalg.norm(want) < 3e-2
    eights = torch.cat([k.moe(xt[a:a + 8], w13g, w2g, wtg[a:a + 8], idg[a:a + 8], k.Q4_K, k.Q6_K, _act, silu=True,
                              form=form) for a in range(0, tokens, 8)])
    # the same pairs, only grouped differently: fp32 sums of the same products, rounded to bf16 once
    assert float((got.float() - eights.float()).norm() / eights.float().norm()) < 1e-2


def test_linear_chunks_in_a_cuda_graph_replayed_with_new_inputs():
    """vLLM captures decode batches past 8 tokens too (its capture sizes reach 512): 24 tokens, 3 chunks, one
    graph, inputs changed between 1000 replays."""
    k = kq()
    rng = np.random.default_rng(46)
    rows, cols, n = 96, 2048, 24
    stored, truth = weights("Q4_K", (rows, cols), seed=47)
    w = torch.from_numpy(stored).cuda()
    segs = (k.Segment(k.Q4_K, 0, rows),)
    x = torch.zeros(n, cols, dtype=torch.bfloat16, device="cuda")
    graph, out = _captured(lambda: k.linear_chunks(x, w, segs))
    for i in range(1000):
        xi = exact_activations(rng, n, cols)
        x.copy_(torch.from_numpy(xi))
        graph.replay()
        if i % 200 == 0 or i == 999:
            check(out, xi.astype(np.float64) @ truth.T, np.abs(xi) @ np.abs(truth).T, torch.bfloat16)


def test_residency_is_computed_as_the_driver_answers(limits):
    """kquant.resident_blocks (the warp choice's input, computed so emulated limits can apply) against CUDA's
    occupancy query, for every mma entry and weight type, 1-8 warps, on the GPU's own limits."""
    if limits.name != torch.cuda.get_device_properties(0).name:
        pytest.skip("emulated limits: the driver's occupancy query answers for the GPU in hand")
    from cupy_backends.cuda.api import driver

    k = kq()
    from fastcomm.kquant import ops  # the launchers' own (cached) function handles and residency

    for kernel, dtype, moe in ((k.abi.KQ_MMA, "bfloat16", False), (k.abi.KQ_MOE_MMA_UP, "bfloat16", True),
                               (k.abi.KQ_MOE_MMA_DOWN, None, True)):
        for t in (k.Q4_K, k.Q5_K, k.Q6_K, k.Q8_0):
            ring = k.mma_ring_bytes([t])
            symbol = kernel.symbol(dtype, k.mma_variant([t], moe))
            fn = ops._smem_function(0, symbol)
            want = tuple(driver.occupancyMaxActiveBlocksPerMultiprocessor(fn, 32 * w, k.mma_smem(w, ring))
                         for w in range(1, k.abi.KQ_MMA_WARPS + 1))
            assert ops._resident(0, symbol, ring) == want, (symbol, k.NAMES[t])


def test_this_gpus_forms_table_runs_at_its_shapes(limits):
    """The forms table this GPU serves (fastcomm.kquant.forms, FASTCOMM_GGUF_FORMS=auto) at each of its shapes and
    token counts, in the full size of the shard's layer: the table's form runs and agrees with the rule's to the
    int8 activations' error, as the layer would take it (kquant_vllm.linear_plan / moe_plan's forms_for). Skipped
    where no table is for this GPU (the sm_120 emulation plans for a GPU no table names)."""
    from fastcomm.kquant import forms as measured
    from fastcomm_bench import gguf_kernels  # the benchmark's weights and routes: those the table was timed on

    k = kq()
    table = measured.resolve("auto", limits.name)
    if table is None:
        pytest.skip(f"no forms table for {limits.name}")
    rng = np.random.default_rng(3)
    ran = 0
    for entry in table.entries:
        s = entry.shape
        if isinstance(s, measured.LinearShape):
            stored, _, segs, _ = gguf_kernels.linear_weight(rng, [(k.NAMES[t], r) for t, r in zip(s.types, s.rows)],
                                                            s.cols)
            use = measured.forms_for(table, s, tensor_cores=True, mma=k.mma_ok(segs, s.cols))
            w = torch.from_numpy(stored).cuda()
            for n, form in enumerate(use, start=1):
                if not form:
                    continue
                x = torch.randn(n, s.cols, dtype=torch.bfloat16, device="cuda") * 0.1
                got, rule = k.linear(x, w, segs, form=form).float(), k.linear(x, w, segs).float()
                assert torch.isfinite(got).all(), (entry.op, n, form)
                assert float((got - rule).norm() / rule.norm()) < 2e-2, (entry.op, n, form)
                ran += 1
        else:
            experts = 2 * s.topk * k.MAX_TOKENS  # routes distinct across a step's tokens, as the shard's
            moe = ("routed experts", experts, s.topk, s.hidden, s.inter, k.NAMES[s.t13], k.NAMES[s.t2], 1)
            a, b, _, _ = gguf_kernels.moe_weights(rng, moe)
            w13, w2 = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
            fits = lambda n: k.moe_stage_bytes(n, s.topk, s.hidden, s.inter) <= limits.smem_per_block  # noqa: E731
            use = measured.forms_for(table, s, tensor_cores=True, staged_fits=fits)
            for n, form in enumerate(use, start=1):
                if not form:
                    continue
                x = torch.randn(n, s.hidden, dtype=torch.bfloat16, device="cuda") * 0.1
                ids = torch.from_numpy(gguf_kernels.route_ids(n, experts, s.topk, rng)).cuda()
                wts = torch.rand(n, s.topk, device="cuda")
                got = k.moe(x, w13, w2, wts, ids, s.t13, s.t2, None, silu=True, form=form).float()
                rule = k.moe(x, w13, w2, wts, ids, s.t13, s.t2, None, silu=True).float()
                assert torch.isfinite(got).all(), (entry.op, n, form)
                assert float((got - rule).norm() / rule.norm()) < 2e-2, (entry.op, n, form)
                ran += 1
    assert ran, "the table names no form this GPU runs"
