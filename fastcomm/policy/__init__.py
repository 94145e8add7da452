"""Every decision fastcomm takes, as pure functions over plain data (no torch, no CUDA, no probing).

- ``links``: link classes, the worst link, islands, the P2P summary;
- ``rules``: the size -> algorithm table per (transport, link, world size), and its one text form;
- ``checks``: can an input run at all (a reason string when not);
- ``launch``: grid, block and kernel parameters;
- ``plan``: facts + settings -> the frozen plan a workspace is built for;
- ``nccl``: NCCL settings for what stays on NCCL;
- ``wire``: bytes each GPU sends per call, per implementation;
- ``fused``: which fused all-reduce + RMSNorm kernel serves an input.
"""
from .checks import DTYPE_SIZE, FUSED_MAX_ROW_BYTES, SUPPORTED_DTYPES, check_fused, check_fused_two_shot, \
    check_tensor
from .fused import FusedAlgo, choose_fused
from .launch import Launch, cdiv, fused_launch, fused_two_shot_launch, ll_bytes, num_blocks, one_shot_launch, \
    packets_for, pull_launch, pull_stages, round_up, two_shot_launch, two_shot_ll_launch, two_shot_ll_max_bytes, \
    two_shot_ll_slot_bytes, vectors_for
from .links import LinkType, islands, summarize, validate_islands, worst_link
from .nccl import nccl_env
from .wire import nccl_ring_bytes, wire_bytes, wire_cross, wire_split
from .plan import Facts, Plan, make_plan
from .route import Route, allreduce_route
from .rules import DEFAULT_TABLE, Algo, PolicyKey, Rule, SizeRange, Transport, choose_algo, lookup_rules, \
    render_ranges, size_ranges

__all__ = ["DTYPE_SIZE", "FUSED_MAX_ROW_BYTES", "SUPPORTED_DTYPES", "check_fused", "check_fused_two_shot",
           "check_tensor", "FusedAlgo", "choose_fused", "Launch", "cdiv", "fused_launch", "fused_two_shot_launch",
           "ll_bytes", "num_blocks", "one_shot_launch", "packets_for", "pull_launch", "pull_stages", "round_up",
           "two_shot_launch", "two_shot_ll_launch", "two_shot_ll_max_bytes", "two_shot_ll_slot_bytes",
           "vectors_for",
           "LinkType", "islands", "summarize", "validate_islands", "worst_link", "nccl_env", "Facts", "Plan",
           "make_plan", "DEFAULT_TABLE", "Algo", "PolicyKey", "Rule", "SizeRange", "Transport", "choose_algo",
           "lookup_rules", "render_ranges", "size_ranges", "nccl_ring_bytes", "wire_bytes", "wire_cross", "wire_split",
           "Route", "allreduce_route"]
