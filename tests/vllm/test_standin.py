"""fastcomm_vllm.standin on CPU against vLLM's own layer classes: which modules count as all-reduce sites,
that install() wraps each site class once, and the stand-in op's CPU path (a copy, eager and compiled).
The TP load test (tests/gguf/test_tp_load.py) counts the sites on vLLM's real GLM-5 and MTP models."""
import sys

import pytest

pytest.importorskip("vllm.config")  # a real vLLM: a folder of tests named vllm cannot satisfy it

import torch  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture
def classes():
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MoE

    return RowParallelLinear, VocabParallelEmbedding, ParallelLMHead, DeepseekV2MoE


@pytest.fixture
def restored(classes, monkeypatch):
    """Each class's forward (and the stand-in's start time) put back after the test, whatever install did."""
    from fastcomm_vllm import standin

    for cls in classes:
        monkeypatch.setattr(cls, "forward", cls.__dict__["forward"])
    monkeypatch.setitem(standin._state, "initial_ns", standin._state["initial_ns"])
    return standin


def bare(cls, **attrs):
    """An instance of a vLLM layer class without its constructor (which needs a TP group): enough for the
    stand-in, which looks only at the class and reduce_results."""
    m = cls.__new__(cls)
    torch.nn.Module.__init__(m)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def test_sites_are_the_modules_that_all_reduce_at_tp_above_1(classes):
    from fastcomm_vllm import standin

    row, embedding, lm_head, moe = classes
    model = torch.nn.ModuleList([bare(row, reduce_results=True), bare(row, reduce_results=False),
                                 bare(embedding), bare(lm_head), bare(moe), torch.nn.Linear(2, 2)])
    # o_proj, the embedding, the MoE block; not a row-parallel linear whose caller reduces (the shared
    # expert's down_proj), nor the LM head (a VocabParallelEmbedding whose logits are gathered, not summed).
    assert standin.count_sites(model) == 3
    assert not standin._reduces(model[3]) and issubclass(lm_head, embedding)


def test_install_wraps_each_site_class_once(classes, restored):
    standin = restored
    row, embedding, lm_head, moe = classes
    before = {cls: cls.forward for cls in classes}
    standin.install(5.0)
    standin.install(5.0)  # vLLM may load plugins more than once per process
    for cls in (row, embedding, moe):
        assert cls.forward._fastcomm_standin and cls.forward.__wrapped__ is before[cls], cls
    assert lm_head.forward is before[lm_head]  # its own forward (which raises: the sampler uses its weight)
    assert standin._state["initial_ns"] == 5000


def test_a_wrapped_forward_returns_the_stand_ins_copy_only_where_tp_would_reduce(classes, restored):
    standin = restored
    row, embedding, lm_head, moe = classes
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    row.forward = lambda self, inp: (inp, "bias")   # RowParallelLinear returns (output, output_bias)
    embedding.forward = lambda self, inp: inp
    moe.forward = lambda self, inp: inp
    standin.install(0.0)
    out, extra = row.forward(bare(row, reduce_results=True), x)
    assert out is not x and torch.equal(out, x) and extra == "bias"
    out, _ = row.forward(bare(row, reduce_results=False), x)
    assert out is x
    for m in (bare(embedding), bare(moe)):
        out = type(m).forward(m, x)
        assert out is not x and torch.equal(out, x)
    assert embedding.forward(bare(lm_head), x) is x  # the LM head, should its class inherit the wrapper


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(0,), (3, 0), (1,), (7,), (4, 6144), (2, 3, 5)])
def test_cpu_op_is_a_new_tensor_equal_to_its_input(dtype, shape, monkeypatch):
    from fastcomm_vllm import standin  # noqa: F401  (defines the op)

    monkeypatch.setitem(sys.modules, "cupy", None)  # an install without CUDA extras: the CPU path needs none
    x = torch.randn(shape).to(dtype)
    kept = x.clone()
    y = torch.ops.fastcomm_standin.all_reduce(x)
    assert y is not x and y.dtype == dtype and y.shape == x.shape and torch.equal(y, kept)
    assert torch.equal(x, kept)  # the input left as it was
    if x.numel():
        assert y.data_ptr() != x.data_ptr()
        x.add_(1)  # out of place: the output does not follow the input
        assert torch.equal(y, kept)


def test_cpu_op_of_a_transposed_input():
    from fastcomm_vllm import standin  # noqa: F401

    x = torch.randn(8, 5).t()
    assert torch.equal(torch.ops.fastcomm_standin.all_reduce(x), x)


def test_cpu_op_traces_whole_under_torch_compile():
    from fastcomm_vllm import standin  # noqa: F401

    # fullgraph: the fake implementation and the schema must let dynamo and AOT autograd trace through the op
    # (aot_eager: the same tracing as inductor, without its seconds of C++ compilation).
    f = torch.compile(lambda a: torch.ops.fastcomm_standin.all_reduce(a * 2) + 1, fullgraph=True,
                      backend="aot_eager")
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(4, 64).to(dtype)
        assert torch.equal(f(x), x * 2 + 1)
    g = torch.compile(torch.ops.fastcomm_standin.all_reduce, fullgraph=True, backend="aot_eager")
    x = torch.randn(16)
    y = g(x)
    assert y is not x and torch.equal(y, x)


def test_register_installs_the_stand_ins_when_the_switch_is_on(classes, restored, monkeypatch):
    from fastcomm_vllm import plugin

    standin = restored
    row, embedding, _, moe = classes
    for name in ("FASTCOMM_TEST_MODE", "FASTCOMM_TEST_STANDIN_US"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FASTCOMM_VLLM", "0")  # the stand-ins alone: no communicator in this process
    plugin.register()
    assert not any(getattr(cls.forward, "_fastcomm_standin", False) for cls in (row, embedding, moe))
    monkeypatch.setenv("FASTCOMM_TEST_MODE", "1")
    monkeypatch.setenv("FASTCOMM_TEST_STANDIN_US", "5")
    plugin.register()
    assert all(getattr(cls.forward, "_fastcomm_standin", False) for cls in (row, embedding, moe))
    assert standin._state["initial_ns"] == 5000


def test_set_us_writes_the_time_made_in_inference_mode(monkeypatch):
    """The time tensor is first made inside vLLM's warm-up (inference mode) and written later by an RPC outside it
    (bench-decode --standin-us): set_us must take (an inference tensor refuses in-place updates out of that mode)."""
    from fastcomm_vllm import standin

    monkeypatch.setitem(standin._state, "ns", None)
    monkeypatch.setitem(standin._state, "initial_ns", 0)
    with torch.inference_mode():
        made = standin._ns_tensor(torch.device("cpu"))
    assert standin.set_us(7.5) == 7.5
    assert standin._state["ns"] is made and int(made.item()) == 7500
