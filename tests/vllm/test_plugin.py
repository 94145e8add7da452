"""The plugin against the real vLLM: entry point, hooks, communicator class (CPU; no mocks of vLLM)."""
import json

import pytest

pytest.importorskip("vllm.config")  # a real vLLM: a folder of tests named vllm cannot satisfy it

import vllm_workers as W  # noqa: E402

pytestmark = pytest.mark.vllm


def test_entry_point_is_registered():
    import importlib.metadata

    from fastcomm_vllm import plugin

    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert "fastcomm" in eps
    assert eps["fastcomm"].load() is plugin.register


def test_classes_resolve_to_vllm_subclasses():
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from fastcomm_vllm import plugin

    assert plugin.VLLM_COMMUNICATOR == f"{CudaCommunicator.__module__}.{CudaCommunicator.__qualname__}"
    assert plugin.VLLM_PASS_MANAGER == f"{PostGradPassManager.__module__}.{PostGradPassManager.__qualname__}"
    assert issubclass(resolve_obj_by_qualname(plugin.COMMUNICATOR), CudaCommunicator)
    assert issubclass(resolve_obj_by_qualname(plugin.PASS_MANAGER), PostGradPassManager)


def test_vllm_loader_runs_register_with_plugin_off():
    # vLLM's own plugin loader, in a fresh process: FASTCOMM_VLLM=0 leaves vLLM as it was, with a log line.
    code = """
import logging, sys
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(name)s %(message)s")
from vllm.plugins import load_general_plugins
load_general_plugins()
print("loaded")
"""
    r = W.run_python(code, env={"FASTCOMM_VLLM": "0", "VLLM_PLUGINS": "fastcomm"})
    assert r.returncode == 0, r.stderr
    assert "fastcomm: plugin off (FASTCOMM_VLLM=0)" in r.stdout and "loaded" in r.stdout


def test_vllm_loader_names_a_fastcomm_name_that_is_no_setting():
    # vLLM's users see no `fastcomm env`: a typo or a removed setting (fastcomm ignores both) is named in the log.
    code = """
import logging, sys
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(name)s %(message)s")
from vllm.plugins import load_general_plugins
load_general_plugins()
"""
    r = W.run_python(code, env={"FASTCOMM_VLLM": "0", "VLLM_PLUGINS": "fastcomm", "FASTCOMM_GGUF_GROUPED_FORM": "x"})
    assert r.returncode == 0, r.stderr
    assert "fastcomm: FASTCOMM_GGUF_GROUPED_FORM is not a fastcomm setting; it is ignored" in r.stdout


def test_register_is_inert_off_cuda():
    # This machine's vLLM platform is not CUDA: register() must not touch anything.
    code = """
import sys
from vllm.platforms import current_platform
from fastcomm_vllm import plugin
plugin.register()
print(current_platform.is_cuda(), any(type(f).__name__ == "_WrapOnImport" for f in sys.meta_path))
"""
    r = W.run_python(code, env={"FASTCOMM_VLLM": "1"})
    assert r.returncode == 0, r.stderr
    if r.stdout.split()[-2] == "True":
        pytest.skip("CUDA platform here: covered by the GPU test")
    assert r.stdout.split()[-1] == "False"


# A real vLLM platform class whose communicator answer is CUDA's (what install() checks against).
CUDA_LIKE = """
import json
from vllm.platforms.interface import Platform
from fastcomm_vllm import plugin

class CudaLike(Platform):
    @classmethod
    def get_device_communicator_cls(cls):
        return plugin.VLLM_COMMUNICATOR
"""


def test_install_points_the_platform_at_fastcomm():
    code = CUDA_LIKE + """
from vllm.config.compilation import CompilationConfig
from vllm.utils.import_utils import resolve_obj_by_qualname
before = CompilationConfig().compute_hash()
plugin.install(CudaLike, fuse=True)
plugin.install(CudaLike, fuse=True)  # idempotent
after = CompilationConfig().compute_hash()
comm = resolve_obj_by_qualname(CudaLike.get_device_communicator_cls())

class Other(Platform):
    @classmethod
    def get_device_communicator_cls(cls):
        return "someone.else.Communicator"
try:
    plugin.install(Other)
    conflict = None
except RuntimeError as e:
    conflict = str(e)
untouched = Other.get_pass_manager_cls() == plugin.VLLM_PASS_MANAGER  # nothing half-installed
print(json.dumps(dict(untouched=untouched, comm=comm.__name__, pm=CudaLike.get_pass_manager_cls(), hash_changed=before != after,
    hash_stable=after == CompilationConfig().compute_hash(), conflict=conflict,
    op=hasattr(__import__("torch").ops.fastcomm_vllm, "fused_all_reduce_rms_norm"))))
"""
    r = W.run_python(code)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["comm"] == "FastcommCudaCommunicator"
    assert got["pm"] == "fastcomm_vllm.compile_pass.FastcommPassManager"
    assert got["hash_changed"] and got["hash_stable"], got
    assert got["conflict"] and "someone.else.Communicator" in got["conflict"] and got["untouched"]
    assert got["op"]


@pytest.fixture(scope="module")
def cpu_ranks():
    # Two gloo ranks on CPU, through the library's harness (one deadline, survivors killed). PyNccl needs a
    # GPU, so vLLM's own switch turns it off.
    from fastcomm.spawn import check_all_ok, run_ranks

    return check_all_ok(run_ranks(W.cpu_communicator, 2, timeout=240, env={"VLLM_DISABLE_PYNCCL": "1"},
                                  backend="gloo"))


def test_communicator_falls_back_on_every_rank_without_cuda(cpu_ranks):
    # The workspace is refused on every rank (agreed, no hang), vLLM's all-reduce sums, non-TP groups never
    # try, destroy() works.
    for r in cpu_ranks:
        assert r["workspace"] is None and "not CUDA" in r["why_not"]
        assert r["sum_error"] == 0.0 and not r["input_changed"]
        assert "not a tensor-parallel group" in r["pp_why_not"]


def test_device_timeout_reaches_vllm_in_fastcomms_words(cpu_ranks):
    # After a device-side timeout CUDA reports only a launch failure: the communicator re-raises it as the
    # FastcommTimeoutError naming rank, peer and step, and the workspace's watcher puts that message in
    # vLLM's log at once (for failures that surface outside the all-reduce).
    for rank, r in enumerate(cpu_ranks):
        t = r["timeouts"]
        assert t["opened"]
        # No timeout recorded: CUDA's error is not fastcomm's, and passes unchanged.
        assert t["no_record"] == {"type": "RuntimeError", "message": "CUDA error: unspecified launch failure",
                                  "same": True, "cause": None}
        rec = t["recorded"]
        assert rec["type"] == "FastcommTimeoutError" and rec["cause"] == "RuntimeError" and not rec["same"]
        assert f"rank {rank} timed out" in rec["message"] and f"peer rank {1 - rank}" in rec["message"]
        assert "one-shot exchange" in rec["message"]
        assert t["logged"] == [("ERROR", rec["message"])]
        # fastcomm's own error is already in its words: not wrapped again.
        assert t["fastcomm_own"] == {"type": "FastcommTimeoutError", "message": "fastcomm: its own words",
                                     "same": False, "cause": None}


@pytest.mark.gpu
def test_vllm_tp_group_on_gpus():
    import torch

    from fastcomm.spawn import check_all_ok, run_ranks

    world, replays = min(torch.cuda.device_count(), 8), 20
    if world < 2:
        pytest.skip("vLLM's tensor-parallel group needs NCCL, which refuses ranks sharing a GPU: 2+ GPUs")
    res = check_all_ok(run_ranks(W.gpu_vllm_tp, world, replays, timeout=600, backend="nccl"))
    print(res[0])
    assert all(r["closed"] for r in res)
    for r in res:
        assert len(r["replay_errors"]) == replays and max(r["replay_errors"]) == 0.0, r["replay_errors"]
        assert all(r[f"why_not_fused_{t}"] is None for t in (1, 8, 64))  # the fused kernel took these
        above = r["above_fused_range"]
        if above is not None:  # None: the fused range reaches 8192 tokens of 4096 here
            assert above["why_not"] and above["helper_equal"] and above["op_residual_equal"], above
            assert above["op_ulps"] <= 3.0, above


def test_fusion_switch_keeps_the_communicator_only():
    # Without the fusion the compiled graphs are vLLM's own, so the compile-cache key must stay vLLM's:
    # such a run shares compiled graphs with plain vLLM (minutes of start-up on a 78-layer model).
    code = CUDA_LIKE + """
from vllm.config.compilation import CompilationConfig
before = CompilationConfig().compute_hash()
plugin.install(CudaLike, fuse=False)
print(json.dumps(dict(comm=CudaLike.get_device_communicator_cls(), pm=CudaLike.get_pass_manager_cls(),
                      same_hash=before == CompilationConfig().compute_hash())))
"""
    r = W.run_python(code)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    from fastcomm_vllm import plugin

    assert got["comm"] == plugin.COMMUNICATOR and got["pm"] == plugin.VLLM_PASS_MANAGER
    assert got["same_hash"], got
