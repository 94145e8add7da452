"""The all-reduce + RMSNorm fusion: the compile pass on traced graphs, and the DSA helper routing (CPU)."""
import operator

import pytest

pytest.importorskip("vllm.config")  # a real vLLM: a folder of tests named vllm cannot satisfy it

import torch  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import vllm_workers as W  # noqa: E402

pytestmark = pytest.mark.vllm
WORLD = 2  # simulated ranks holding the same partial sums
EPS = 1e-5


@pytest.fixture(scope="module")
def ops():
    import vllm.distributed.parallel_state  # noqa: F401 -- torch.ops.vllm.all_reduce
    import vllm.ir.ops  # noqa: F401 -- torch.ops.vllm_ir.*

    from fastcomm_vllm import compile_pass, fused_op

    fused_op.register_ops()
    return compile_pass


def layer(x_embed, x_attn, x_mlp, w1, w2, w3):
    """The shape of a decoder step: embedding all-reduce -> rms_norm (its output is also the residual),
    o_proj all-reduce -> fused_add_rms_norm, MLP all-reduce -> final fused_add_rms_norm (output only)."""
    emb = torch.ops.vllm.all_reduce(x_embed, group_name="tp:0")
    h = torch.ops.vllm_ir.rms_norm(emb, w1, EPS)
    attn = torch.ops.vllm.all_reduce(x_attn + h, group_name="tp:0")
    h2, residual = torch.ops.vllm_ir.fused_add_rms_norm(attn, emb, w2, EPS)
    mlp = torch.ops.vllm.all_reduce(x_mlp * h2, group_name="tp:0")
    final, _ = torch.ops.vllm_ir.fused_add_rms_norm(mlp, residual, w3, EPS)
    return final


def inputs(dtype=torch.float32, tokens=5, hidden=64):
    g = torch.Generator().manual_seed(0)
    acts = [torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(3)]
    weights = [(torch.rand(hidden, generator=g) + 0.5).to(dtype) for _ in range(3)]
    return acts + weights


def trace(fn, args):
    return make_fx(fn, tracing_mode="fake")(*args)


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


class Reference(torch.fx.Interpreter):
    """Runs a graph with all-reduce = WORLD identical partials, and the fused op by its definition
    (vLLM's native norm on the reduced sum), so the check is about the rewrite's wiring."""

    def call_function(self, target, args, kwargs):
        if target is torch.ops.vllm.all_reduce.default:
            return args[0] * WORLD
        if target is torch.ops.fastcomm_vllm.fused_all_reduce_rms_norm.default:
            import vllm.ir.ops

            x, residual, weight, eps, _ = args
            reduced = x * WORLD
            if residual is None:
                return vllm.ir.ops.rms_norm.impls["native"].impl_fn(reduced, weight, eps), reduced
            return vllm.ir.ops.fused_add_rms_norm.impls["native"].impl_fn(reduced, residual, weight, eps)
        if target in (torch.ops.vllm_ir.rms_norm.default, torch.ops.vllm_ir.fused_add_rms_norm.default):
            import vllm.ir.ops

            op = vllm.ir.ops.rms_norm if target is torch.ops.vllm_ir.rms_norm.default else vllm.ir.ops.fused_add_rms_norm
            return op.impls["native"].impl_fn(*args, **kwargs)
        return super().call_function(target, args, kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pass_rewrites_every_pair_and_keeps_outputs(ops, dtype):
    args = inputs(dtype)
    gm = trace(layer, args)
    before = Reference(gm).run(*args)
    p = ops.FastcommFusionPass(eligible=lambda name: name == "tp:0")
    p(gm.graph)
    gm.graph.lint()
    gm.recompile()
    assert p.rewrites == 3
    t = targets(gm)
    assert t.count(torch.ops.fastcomm_vllm.fused_all_reduce_rms_norm.default) == 3
    assert torch.ops.vllm.all_reduce.default not in t
    assert torch.ops.vllm_ir.rms_norm.default not in t and torch.ops.vllm_ir.fused_add_rms_norm.default not in t
    fused = [n for n in gm.graph.nodes if n.target is torch.ops.fastcomm_vllm.fused_all_reduce_rms_norm.default]
    assert fused[0].args[1] is None and all(n.args[1] is not None for n in fused[1:])  # residual where due
    assert all(n.args[3] == EPS and n.args[4] == "tp:0" for n in fused)
    after = Reference(gm).run(*args)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    # The rewritten graph still traces: the op's fake implementation gives the right metadata.
    again = trace(gm, args)
    vals = [n.meta["val"] for n in again.graph.nodes if n.target is torch.ops.fastcomm_vllm.fused_all_reduce_rms_norm.default]
    assert len(vals) == 3 and all(v[0].shape == v[1].shape == args[0].shape and v[0].dtype == dtype for v in vals)


def test_inductor_lowers_the_rewritten_graph(ops):
    # vLLM runs the pass inside Inductor; the op must lower (as an opaque fallback kernel) with its
    # optional residual and string group name.
    from torch._inductor.compile_fx import compile_fx

    args = inputs()
    gm = trace(layer, args)
    ops.FastcommFusionPass(eligible=lambda name: True)(gm.graph)
    gm.recompile()
    assert callable(compile_fx(gm, args))


def test_pass_skips_groups_without_workspace(ops):
    gm = trace(layer, inputs())
    p = ops.FastcommFusionPass(eligible=lambda name: False)
    p(gm.graph)
    assert p.rewrites == 0 and torch.ops.vllm.all_reduce.default in targets(gm)


def test_pass_default_eligibility_needs_a_vllm_group(ops):
    # No vLLM groups exist here, so the default check (the group's fastcomm workspace) declines.
    gm = trace(layer, inputs())
    p = ops.FastcommFusionPass()
    p(gm.graph)
    assert p.rewrites == 0


def test_pass_leaves_pairs_it_cannot_fuse(ops):
    def f(x, r, w):
        ar = torch.ops.vllm.all_reduce(x, group_name="tp:0")
        out, res = torch.ops.vllm_ir.fused_add_rms_norm(ar, r, w, EPS)
        return out + ar, res  # all_reduce(x) alone is needed too: not what the fused op returns

    def g(x, r, w):
        ar = torch.ops.vllm.all_reduce(x, group_name="tp:0")
        return torch.ops.vllm_ir.rms_norm(ar, w, EPS, 32)  # variance over part of the row

    def h(x, r, w):
        ar = torch.ops.vllm.all_reduce(x, group_name="tp:0")
        early = ar * 2  # a reader before the norm
        return torch.ops.vllm_ir.rms_norm(early + ar, w, EPS), torch.ops.vllm_ir.rms_norm(ar, w, EPS)

    args = [torch.randn(4, 64), torch.randn(4, 64), torch.rand(64)]
    for fn in (f, g, h):
        gm = trace(fn, args)
        p = ops.FastcommFusionPass(eligible=lambda name: True)
        p(gm.graph)
        assert p.rewrites == 0, fn.__name__


def test_pass_sees_through_shape_preserving_views(ops):
    def f(x, r, w):
        ar = torch.ops.vllm.all_reduce(x, group_name="tp:0")
        return torch.ops.vllm_ir.fused_add_rms_norm(ar.view(4, 64), r, w, EPS)

    args = [torch.randn(4, 64), torch.randn(4, 64), torch.rand(64) + 0.5]
    gm = trace(f, args)
    before = Reference(gm).run(*args)
    p = ops.FastcommFusionPass(eligible=lambda name: True)
    p(gm.graph)
    gm.graph.lint()
    gm.recompile()
    assert p.rewrites == 1
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and n.target not in
                (torch.ops.fastcomm_vllm.fused_all_reduce_rms_norm.default, operator.getitem)]
    torch.testing.assert_close(Reference(gm).run(*args), before, rtol=0, atol=0)


def test_pass_manager_appends_the_pass(ops):
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig
    from vllm.config.utils import Range

    def config(tp):  # device given: this machine has no GPU for vLLM to infer one from
        return VllmConfig(device_config=DeviceConfig(device="cpu"), parallel_config=ParallelConfig(tensor_parallel_size=tp))

    pm, vanilla, single = ops.FastcommPassManager(), PostGradPassManager(), ops.FastcommPassManager()
    pm.configure(config(2))
    vanilla.configure(config(2))
    single.configure(config(1))
    assert isinstance(pm.passes[-1], ops.FastcommFusionPass)
    assert not any(isinstance(p, ops.FastcommFusionPass) for p in single.passes)
    with pass_context(Range(1, 8)):  # the uuid keys Inductor's cache: it must see the extra pass
        assert pm.uuid() != vanilla.uuid()


def test_dsa_helper_is_wrapped_when_glm5_model_module_loads():
    # Fresh process: route first, then import vLLM's DSA model module (GLM-5's class) the way vLLM would.
    # The helper's defining module differs between vLLM releases; the model module is the same.
    code = """
import json, sys
from fastcomm_vllm import helper_route
helper_route.route_fused_helper()
helper_route.route_fused_helper()  # idempotent
before = helper_route.helper_routed()
import vllm.models.deepseek_v32.nvidia.model as model_mod
w = model_mod.fused_allreduce_rms_norm
defining = w._fastcomm_original.__module__
print(json.dumps(dict(before=before, after=helper_route.helper_routed(), defining=defining,
    same=w is getattr(sys.modules[defining], "fused_allreduce_rms_norm"), name=w.__name__)))
"""
    from fastcomm_vllm import helper_route

    _skip_unless_dsa_model_imports()
    r = W.run_python(code)
    assert r.returncode == 0, r.stderr[-3000:]
    got = __import__("json").loads(r.stdout.strip().splitlines()[-1])
    assert got.pop("defining") in helper_route.HELPER_MODULES
    assert got == dict(before=False, after=True, same=True, name="fused_allreduce_rms_norm")


def _skip_unless_dsa_model_imports():
    # vLLM 0.25's DSA module needs its compiled ops (vllm._C) to import; without a GPU build it cannot load.
    r = W.run_python("import vllm.models.deepseek_v32.nvidia.model")
    if r.returncode != 0:
        pytest.skip("vLLM's DSA model module does not import here: " + r.stderr.strip().splitlines()[-1])


def test_dsa_helper_rebinds_consumers_imported_earlier():
    _skip_unless_dsa_model_imports()
    code = """
import vllm.models.deepseek_v32.nvidia.model as model_mod
original = model_mod.fused_allreduce_rms_norm
from fastcomm_vllm import helper_route
helper_route.route_fused_helper()
print(model_mod.fused_allreduce_rms_norm._fastcomm_original is original)
"""
    r = W.run_python(code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "True"
