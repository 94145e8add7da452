"""policy.allreduce_route: one answer per all-reduce (algorithm, kernel, tables, launch shape), pure, the
same for any rank, and what ops launches (ops._run only packs the route's kernel parameters)."""
import pytest

from fastcomm import abi
from fastcomm import policy as P
from fastcomm.config import Config
from fastcomm.policy import Algo, LinkType

KB = 1024


def _plan(world=8, **cfg):
    return P.make_plan(P.Facts(world_size=world, all_p2p=True, link=LinkType.PCIE_SWITCH, num_sms=188), Config(**cfg))


@pytest.mark.parametrize("algo,kernel", [("one_shot", abi.ONE_SHOT), ("two_shot", abi.TWO_SHOT),
                                         ("two_shot_ll", abi.TWO_SHOT_LL)])
def test_each_forced_algorithm_routes_to_its_kernel_on_the_flat_table(algo, kernel):
    plan = _plan(algo=algo)
    r = P.allreduce_route(plan, 12 * KB, 2)
    assert (r.algo.value, r.kernel, r.groups) == (algo, kernel, (abi.FLAT,))
    # the launch shape is the policy's own function of the size, world and block cap
    want = {"one_shot": lambda: P.one_shot_launch(12 * KB, plan.max_blocks),
            "two_shot": lambda: P.two_shot_launch(6 * KB, 2, 8, plan.max_blocks),
            "two_shot_ll": lambda: P.two_shot_ll_launch(12 * KB, 8, plan.max_blocks)}[algo]()
    assert r.launch == want


def test_the_pull_takes_its_one_or_two_stage_kernel_by_size():
    plan = _plan(algo="pull")
    stages = {P.allreduce_route(plan, n, 2).kernel for n in (4 * KB, 4096 * KB)}
    assert stages <= {abi.PULL, abi.PULL2}
    for n in (4 * KB, 4096 * KB):
        r = P.allreduce_route(plan, n, 2)
        assert r.kernel is (abi.PULL if P.pull_stages(n, 8) == 1 else abi.PULL2) and r.launch.stages in (1, 2)


def test_islands_take_the_island_then_partner_tables():
    plan = _plan(islands=((0, 1, 2, 3), (4, 5, 6, 7)), algo="one_shot")
    r = P.allreduce_route(plan, 12 * KB, 2)
    assert (r.kernel, r.groups) == (abi.ONE_SHOT_ISLANDS, (abi.ISLAND, abi.PARTNER))
    plan = _plan(islands=((0, 1, 2, 3), (4, 5, 6, 7)), algo="two_shot_islands")
    r = P.allreduce_route(plan, 1024 * KB, 2)
    assert (r.kernel, r.groups) == (abi.TWO_SHOT_ISLANDS, (abi.ISLAND, abi.PARTNER))
    assert r.launch == P.two_shot_launch(512 * KB, 2, 4, plan.max_blocks)  # cut for a world of the island's size


def test_sizes_the_plan_leaves_to_nccl_have_no_kernel_and_auto_keeps_a_forced_plan():
    plan = _plan()
    assert P.allreduce_route(plan, plan.max_bytes + 16, 2) == P.Route(Algo.NCCL)
    forced = _plan(algo="two_shot")
    # "auto" from a call means the plan's answer, which FASTCOMM_ALGO forced
    assert P.allreduce_route(forced, 12 * KB, 2, "auto").algo is Algo.TWO_SHOT
    assert P.allreduce_route(forced, 12 * KB, 2, "one_shot").algo is Algo.ONE_SHOT


def test_every_routed_kernel_gets_every_parameter_from_ops():
    """ops._all_reduce_args fills a kernel's parameters by name: each all-reduce kernel's names must be ones
    it knows (a renamed parameter would fail here, not on a GPU)."""
    from fastcomm import ops

    known = set(ops._TABLE_PARAMS) | {"in", "out", "nbytes", "n", "seg", "chunk"}
    for kernel in (abi.ONE_SHOT, abi.ONE_SHOT_ISLANDS, abi.TWO_SHOT, abi.TWO_SHOT_ISLANDS, abi.TWO_SHOT_LL,
                   abi.PULL, abi.PULL2):
        assert {name for name, _ in kernel.params} <= known, kernel.family
