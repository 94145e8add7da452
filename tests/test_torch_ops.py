"""The torch custom ops exist without a GPU and trace under fake tensors (what torch.compile needs)."""
import pytest

torch = pytest.importorskip("torch")

import fastcomm  # noqa: E402
from fastcomm.errors import FastcommError  # noqa: E402


def test_ops_register_and_trace_with_fake_tensors():
    from torch.fx.experimental.proxy_tensor import make_fx

    fastcomm.register_torch_ops()
    fastcomm.register_torch_ops()  # idempotent

    def f(x, res, w):
        y = torch.ops.fastcomm.all_reduce(x, 7, "auto")
        out, r = torch.ops.fastcomm.fused_all_reduce_rmsnorm(y, res, w, 1e-5, 7)
        return out + r

    g = make_fx(f, tracing_mode="fake")(torch.randn(4, 64), torch.randn(4, 64), torch.randn(64))
    targets = [str(n.target) for n in g.graph.nodes if n.op == "call_function"]
    assert "fastcomm.all_reduce.default" in targets
    assert "fastcomm.fused_all_reduce_rmsnorm.default" in targets


def test_op_with_an_unknown_workspace_id_raises_clearly():
    fastcomm.register_torch_ops()
    with pytest.raises(FastcommError, match="no open fastcomm workspace with id 123456"):
        torch.ops.fastcomm.all_reduce(torch.ones(4), 123456, "auto")


class _Declining:
    """Stands in for a Workspace whose policy declines (fastcomm's own class; it needs GPUs to build); its
    routing decision is the real ``Workspace.route``."""

    route = fastcomm.Workspace.route

    def __init__(self, closed=False, reason=None, algo=fastcomm.Algo.NCCL):
        self.closed, self.reason, self.algo = closed, reason, algo
        self.plan = self  # policy.allreduce_route asks the plan for the size's algorithm

    def raise_if_failed(self):
        pass

    def tensor_reason(self, x):
        return self.reason

    def algo_for(self, nbytes, forced=None):
        return self.algo


def test_try_all_reduce_declines_without_launching():
    x = torch.ones(8)
    assert fastcomm.try_all_reduce(x, _Declining(closed=True, algo=fastcomm.Algo.ONE_SHOT)) is None
    assert fastcomm.try_all_reduce(x, _Declining(reason="not on this GPU", algo=fastcomm.Algo.ONE_SHOT)) is None
    assert fastcomm.try_all_reduce(x, _Declining()) is None  # the policy sends it to NCCL
