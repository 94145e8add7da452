"""fastcomm/abi.py against the CUDA sources it mirrors: constants, struct layouts, step ids, kernel signatures.

Read from csrc/ as text, so a change on one side that is not made on the other fails here, on the CPU.
"""
import ctypes
import re

import pytest

from fastcomm import abi
from fastcomm.jit import source_dir

COMMON = (source_dir() / "common.cuh").read_text()
# Step ids a kernel family adds for itself live in its own file (two_shot_islands.cuh).
ALL_SOURCES = "\n".join(p.read_text() for p in sorted(source_dir().glob("*.cu*")))
KERNELS = (source_dir() / "kernels.cu").read_text()
_C_TYPES = {"u32": "u32", "u64": "u64", "float": "f32", "unsigned": "u32"}


def _define(name: str) -> int:
    m = re.search(rf"#define {name} (\d+)", COMMON)
    assert m, f"{name} not defined in common.cuh"
    return int(m.group(1))


def _struct_fields(name: str) -> list[str]:
    body = re.search(rf"struct {name} {{(.*?)\n}};", COMMON, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    names = []
    for decl in body.split(";"):
        decl = decl.strip()
        if not decl or "(" in decl:  # methods
            continue
        names.append(re.match(r".*?\**\s*(\w+)\s*(\[|$)", decl).group(1))
    return names


@pytest.mark.parametrize("name,value", [("FC_MAX_WORLD", abi.MAX_WORLD), ("FC_MAX_BLOCKS", abi.MAX_BLOCKS),
                                        ("FC_PACKET_BYTES", abi.PACKET_BYTES),
                                        ("FC_PACKET_PAYLOAD", abi.PACKET_PAYLOAD),
                                        ("FC_VEC_BYTES", abi.VEC_BYTES), ("FC_LP_BUFFERS", abi.LP_BUFFERS),
                                        ("FC_STEP_ONE_SHOT", abi.STEP_ONE_SHOT), ("FC_STEP_RS", abi.STEP_RS),
                                        ("FC_STEP_AG", abi.STEP_AG), ("FC_STEP_FUSED", abi.STEP_FUSED),
                                        ("FC_STEP_PULL", abi.STEP_PULL), ("FC_STEP_PULL_AG", abi.STEP_PULL_AG)])
def test_constants_match(name, value):
    assert _define(name) == value


def test_every_step_has_a_name():
    found = re.findall(r"#define FC_STEP_\w+ (\d+)", ALL_SOURCES)
    steps = {int(v) for v in found}
    assert steps == set(abi.STEPS) and len(found) == len(steps)  # and no id defined twice


@pytest.mark.parametrize("name,value", [("FC_STEP_ISL_RS", abi.STEP_ISL_RS), ("FC_STEP_ISL_X", abi.STEP_ISL_X),
                                        ("FC_STEP_ISL_AG", abi.STEP_ISL_AG)])
def test_island_two_shot_steps_match(name, value):
    m = re.search(rf"#define {name} (\d+)", ALL_SOURCES)
    assert m and int(m.group(1)) == value


@pytest.mark.parametrize("struct,mirror,size", [("FcTable", abi.FcTable, abi.TABLE_BYTES),
                                                ("FcError", abi.ErrorRecord, abi.ERROR_BYTES)])
def test_structs_match_field_for_field(struct, mirror, size):
    assert _struct_fields(struct) == [f[0] for f in mirror._fields_]
    assert ctypes.sizeof(mirror) == size
    assert f"static_assert(sizeof({struct}) == {size}," in COMMON


def _signature(symbol_pattern: str) -> list[str]:
    m = re.search(symbol_pattern + r"\s*\(([^)]*)\)", KERNELS)
    assert m, f"no kernel matching {symbol_pattern} in kernels.cu"
    types = []
    for param in m.group(1).replace("\\", " ").split(","):
        param = " ".join(param.replace("const ", "").split())
        base = param.split()[0]
        types.append("ptr" if "*" in param else _C_TYPES[base])
    return types


@pytest.mark.parametrize("kernel", abi.KERNELS, ids=lambda k: k.family)
def test_kernel_table_matches_kernels_cu(kernel):
    # The launch file defines fc_<family>[##K]_##NAME(...) through macros; the first match is the signature.
    variant = r"##K##" if kernel.variants != ("",) else ""
    name = rf"fc_{kernel.family}{variant}_##NAME" if kernel.typed else rf"fc_{kernel.family}"
    assert _signature(name) == [t for _, t in kernel.params]
    for dtype, suffix in abi.DTYPE_SUFFIX.items():
        assert re.search(rf"FC_DEFINE\({suffix}, ", KERNELS), f"no FC_DEFINE for {dtype}"
    if variant:
        defined = re.findall(r"FC_DEFINE_FUSED\(NAME, D, (\d+)\)", KERNELS)
        assert tuple(defined) == kernel.variants


def test_pack_checks_the_argument_count():
    packed = abi.ONE_SHOT.pack(1, 2, 3, 4)
    assert [v.value for v in packed.values] == [1, 2, 3, 4] and packed.address
    with pytest.raises(TypeError, match="one_shot takes 4 arguments"):
        abi.ONE_SHOT.pack(1, 2)
    with pytest.raises(ValueError, match="no variant"):
        abi.FUSED_RMSNORM.symbol("bfloat16", "3")


def test_island_two_shot_timeouts_name_the_step_and_group():
    from fastcomm.errors import describe

    rec = abi.ErrorRecord()
    rec.code, rec.rank, rec.peer, rec.step, rec.group, rec.epoch = 1, 1, 5, abi.STEP_ISL_X, abi.PARTNER, 7
    msg = describe(rec, 3.0)
    assert "rank 1 timed out" in msg and "peer rank 5" in msg
    assert "island two-shot exchange across islands (cross-island partners" in msg
    rec.step, rec.group = abi.STEP_ISL_AG, abi.ISLAND
    assert "island two-shot all-gather (inside the island) (island," in describe(rec, 3.0)
