"""The one-GPU TP harness and the start-up and helper hooks it relies on, against the real vLLM (CPU).
The harness itself runs on a GPU (tests/gguf/tp_one_gpu.py, bench/device_gguf.sh tp)."""
import subprocess
import sys
import types

import pytest

pytest.importorskip("vllm.config")  # a real vLLM: a folder of tests named vllm cannot satisfy it

pytestmark = pytest.mark.vllm


def test_harness_refuses_outside_test_mode():
    code = ("from fastcomm_vllm import one_gpu\n"
            "try:\n    one_gpu.engine_kwargs(8)\nexcept RuntimeError as e:\n    print(e)\n")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("FASTCOMM_TEST")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert "needs FASTCOMM_TEST_MODE=1" in r.stdout, r.stderr[-3000:]


def test_harness_kwargs_and_the_vllm_methods_it_overrides(monkeypatch):
    from vllm.config import ParallelConfig
    from vllm.v1.worker.gpu_worker import Worker

    from fastcomm_vllm import one_gpu

    for name, value in one_gpu.environment().items():  # engine_kwargs sets them: monkeypatch restores them
        monkeypatch.setenv(name, value)
    kw = one_gpu.engine_kwargs(8)
    assert kw["distributed_executor_backend"] == "mp" and kw["worker_cls"] == one_gpu.WORKER
    assert kw["disable_custom_all_reduce"] and kw["kv_cache_memory_bytes"] > 0
    assert "worker_cls" in ParallelConfig.__dataclass_fields__
    for name in ("init_device", "determine_available_memory", "compile_or_warm_up_model"):
        assert callable(getattr(Worker, name)), name  # what the harness and the start-up hook wrap
    assert issubclass(one_gpu.OneGpuWorker, Worker)


def test_warm_up_ends_the_start_up_barriers(monkeypatch):
    """Until the worker's compile_or_warm_up_model returns, the communicator meets its peers at a CPU barrier
    before each eager all-reduce (start-up skew cannot reach FASTCOMM_TIMEOUT_S); after it, never."""
    from fastcomm_vllm import communicator

    class Worker:
        def compile_or_warm_up_model(self):
            return "warmed"

    fake = types.ModuleType("vllm.v1.worker.gpu_worker")
    fake.Worker = Worker
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_worker", fake)
    class Comm:
        fastcomm_ready = False

    c = Comm()
    communicator._OPEN.add(c)
    communicator._mark_ready_after_warm_up()
    communicator._mark_ready_after_warm_up()  # idempotent
    assert Worker.compile_or_warm_up_model._fastcomm
    assert not c.fastcomm_ready
    assert Worker().compile_or_warm_up_model() == "warmed"
    assert c.fastcomm_ready


def test_dsa_helper_reaches_the_communicator_without_the_fusion(monkeypatch):
    """FASTCOMM_VLLM_FUSION unset: where a workspace exists, the helper's all-reduce goes to the group's
    communicator, then the norm; the helper's own path (FlashInfer's kernel, on some GPUs) is not taken."""
    import torch
    import vllm.distributed as vd
    from vllm.distributed import parallel_state

    from fastcomm_vllm import helper_route

    seen = []
    group = types.SimpleNamespace(device_communicator=types.SimpleNamespace(fastcomm_workspace=object()),
                                  unique_name="tp:0")
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: group)
    monkeypatch.setattr(vd, "tensor_model_parallel_all_reduce", lambda x: seen.append("all_reduce") or x * 2)

    def original(h, r, norm):
        seen.append("original")
        return h, r

    wrapped = helper_route.wrap_helper(original, fuse=False)
    h, r = torch.ones(2, 4), torch.zeros(2, 4)
    out = wrapped(h, r, lambda x, res: (x + res, x))
    assert seen == ["all_reduce"] and torch.equal(out[0], 2 * h)
    group.device_communicator.fastcomm_workspace = None
    seen.clear()
    wrapped(h, r, lambda x, res: (x, res))
    assert seen == ["original"]  # no workspace: vLLM's helper unchanged


def test_serve_args_are_the_engine_kwargs_through_vllm_serve_parser(monkeypatch):
    """`vllm serve` reads the harness's options (tests/gguf/serve_gpu.py --one-gpu) into the same engine
    arguments that ``LLM(**engine_kwargs)`` gets."""
    from vllm.engine.arg_utils import EngineArgs
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM 0.25
        from vllm.utils import FlexibleArgumentParser

    from vllm.platforms import current_platform

    from fastcomm_vllm import one_gpu

    if not current_platform.device_type:  # a CPU-only vLLM build reports none; its parser needs one
        monkeypatch.setattr(type(current_platform), "device_type", "cpu")
    for name, value in one_gpu.environment().items():
        monkeypatch.setenv(name, value)
    for tp in (2, 8):
        kw = one_gpu.engine_kwargs(tp)
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        ns = parser.parse_args(["--model", "m", "-tp", str(tp), *one_gpu.serve_args(tp)])
        for name, value in kw.items():  # what EngineArgs.from_cli_args reads (building one needs a device)
            assert getattr(ns, name) == value, (name, getattr(ns, name), value)


def test_the_allreduce_check_finds_a_result_that_is_not_the_exact_sum():
    """FASTCOMM_TEST_CHECK_ALLREDUCE's comparison (the gloo gathers replaced by the terms in hand): the ranks'
    inputs summed in fp32 in rank order and rounded once pass bit for bit, -0.0 and NaN included; one wrong
    element, or ranks holding different results, is recorded."""
    import torch

    from fastcomm_vllm import one_gpu

    g = torch.Generator().manual_seed(3)
    terms = [torch.randn(3, 512, generator=g).to(torch.bfloat16) for _ in range(8)]
    for t in terms:
        t[0, :2] = torch.tensor([-0.0, float("nan")])
    exact = terms[0].float()
    for t in terms[1:]:
        exact = exact + t.float()
    exact = exact.to(torch.bfloat16)
    comm = one_gpu.OneGpuCommunicator.__new__(one_gpu.OneGpuCommunicator)
    comm.calls, comm.checked, comm.mismatches = [(7, 3, one_gpu.FASTCOMM)], 0, []
    results = {}
    comm._gather_all = lambda out: results["all"]
    results["all"] = [exact] * 8
    comm._check_sum(terms, exact)
    assert comm.checked == 1 and comm.mismatches == []
    wrong = exact.clone()
    wrong[2, 5] = wrong[2, 5] * 2 + 1
    results["all"] = [wrong] * 8
    comm._check_sum(terms, wrong)
    m = comm.mismatches[0]
    assert (m["forward"], m["tokens"], m["wrong"], m["ranks_agree"]) == (7, 3, 1, True)
    results["all"] = [exact] * 7 + [wrong]
    comm._check_sum(terms, exact)
    assert comm.mismatches[1]["wrong"] == 0 and not comm.mismatches[1]["ranks_agree"]


def test_routing_is_recorded_with_its_margin_for_decode_sized_forwards():
    """FASTCOMM_TEST_ROUTING's hook on a MoE-shaped module (``gate`` with a float weight and the correction
    bias, ``experts``): the experts sigmoid + bias picks, the margin to the first not picked, and for a forward
    of more than 8 tokens only a mark."""
    import torch
    from torch import nn

    from fastcomm_vllm import one_gpu

    class Moe(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(4, 3, bias=False)
            self.gate.e_score_correction_bias = torch.tensor([0.0, 0.0, 0.5])
            self.experts = nn.Identity()

        def forward(self, x):
            return self.experts(x)

    model = nn.Sequential(Moe())
    with torch.no_grad():
        model[0].gate.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0]]))
    records = one_gpu.record_routing(model, top_k=2)
    model(torch.tensor([[2.0, 0.0, -9.0, 0.0]]))  # scores: sigmoid(2)=0.881, 0.5, 0.5 + ~0 = 0.5001
    model(torch.zeros(9, 4))
    (step, mark) = records
    assert step["module"] == "0" and step["tokens"] == 1 and step["experts"] == [[0, 2]]
    want = torch.sigmoid(torch.tensor(-9.0)).item() + 0.5 - 0.5
    assert abs(step["margin"][0] - want) < 1e-6
    assert mark == {"forward": None, "module": "0", "tokens": 9}
