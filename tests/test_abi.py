"""fastcomm/abi.py against the CUDA sources it mirrors: constants, struct layouts, step ids, kernel signatures.

Read from csrc/ as text, so a change on one side that is not made on the other fails here, on the CPU.
"""
import ctypes
import re

import pytest

from fastcomm import abi
from fastcomm.kquant import abi as kabi
from fastcomm.runtime.jit import source_dir

COMMON = (source_dir() / "comm" / "common.cuh").read_text()
# Step ids a kernel family adds for itself live in its own file (two_shot_islands.cuh).
ALL_SOURCES = "\n".join(p.read_text() for p in sorted(source_dir().glob("**/*.cu*")))
KERNELS = (source_dir() / "comm" / "kernels.cu").read_text()
KQUANT = (source_dir() / "kquant" / "kquant.cu").read_text()
KQUANT_HEADERS = (source_dir() / "kquant" / "kquant.cuh").read_text() + \
    (source_dir() / "kquant" / "kquant_mma.cuh").read_text()
_C_TYPES = {"u32": "u32", "u64": "u64", "float": "f32", "unsigned": "u32", "kq_u64": "u64", "int": "i32",
            "KqSegs": "segs"}


def _define(name: str) -> int:
    m = re.search(rf"#define {name} (\d+)", COMMON)
    assert m, f"{name} not defined in common.cuh"
    return int(m.group(1))


def _struct_fields(name: str, text: str = COMMON) -> list[str]:
    body = re.search(rf"struct {name} {{(.*?)\n}};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    names = []
    for decl in body.split(";"):
        decl = decl.strip()
        if not decl or "(" in decl:  # methods
            continue
        # `int type, rows, row0` declares three fields
        first, *more = decl.split(",")
        names.append(re.match(r".*?\**\s*(\w+)\s*(\[|$)", first.strip()).group(1))
        names += [m.strip() for m in more]
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


def _signature(symbol_pattern: str, text: str = KERNELS) -> list[str]:
    m = re.search(symbol_pattern + r"\s*\(([^)]*)\)", text)
    assert m, f"no kernel matching {symbol_pattern}"
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
    from fastcomm.workspace import describe

    rec = abi.ErrorRecord()
    rec.code, rec.rank, rec.peer, rec.step, rec.group, rec.epoch = 1, 1, 5, abi.STEP_ISL_X, abi.PARTNER, 7
    msg = describe(rec, 3.0)
    assert "rank 1 timed out" in msg and "peer rank 5" in msg
    assert "island two-shot exchange across islands (cross-island partners" in msg
    rec.step, rec.group = abi.STEP_ISL_AG, abi.ISLAND
    assert "island two-shot all-gather (inside the island) (island," in describe(rec, 3.0)


# ---- the K-quant decode kernels (kquant.cuh, kquant_mma.cuh, kquant.cu) -----------------------------------

@pytest.mark.parametrize("name,value", [
    ("FC_KQ_Q8_0", kabi.KQ_Q8_0), ("FC_KQ_Q4_K", kabi.KQ_Q4_K), ("FC_KQ_Q5_K", kabi.KQ_Q5_K), ("FC_KQ_Q6_K", kabi.KQ_Q6_K),
    ("FC_KQ_CHUNK", kabi.KQ_CHUNK), ("FC_KQ_UNIT", kabi.KQ_UNIT), ("FC_KQ_MAX_VECS", kabi.KQ_MAX_VECS),
    ("FC_KQ_MAX_SEGS", kabi.KQ_MAX_SEGS), ("FC_KQ_ROWS_PER_BLOCK", kabi.KQ_ROWS_PER_BLOCK),
    ("FC_KQ_STAGED_THREADS", kabi.KQ_STAGED_THREADS), ("FC_KQ_MMA_ROWS", kabi.KQ_MMA_ROWS),
    ("FC_KQ_MMA_COLS", kabi.KQ_MMA_COLS), ("FC_KQ_MMA_WARPS", kabi.KQ_MMA_WARPS), ("FC_KQ_MAX_PAIRS", kabi.KQ_MAX_PAIRS),
    ("FC_KQ_MMA_STAGES", kabi.KQ_MMA_STAGES), ("FC_KQ_MMA_XSTAGE", kabi.KQ_MMA_XSTAGE),
    ("FC_KQ_MMA_PART", kabi.KQ_MMA_PART)])
def test_kquant_constants_match(name, value):
    found = re.findall(rf"#define {name} (\d+)", KQUANT_HEADERS + KQUANT)
    assert found == [str(value)], (name, found)  # defined once, with the mirrored value


def test_kquant_threads_match():
    assert re.search(r"#define FC_KQ_THREADS \(32 \* FC_KQ_ROWS_PER_BLOCK\)", KQUANT_HEADERS)
    assert kabi.KQ_THREADS == 32 * kabi.KQ_ROWS_PER_BLOCK


@pytest.mark.parametrize("struct,mirror", [("KqSeg", kabi.KqSeg), ("KqSegs", kabi.KqSegs)])
def test_kquant_structs_match_field_for_field(struct, mirror):
    assert _struct_fields(struct, KQUANT_HEADERS) == [f[0] for f in mirror._fields_]
    # by value in the launch: a pointer, a u64 and four ints per segment, then two ints
    assert ctypes.sizeof(kabi.KqSeg) == 32 and ctypes.sizeof(kabi.KqSegs) == kabi.KQ_MAX_SEGS * 32 + 8


# variant suffix -> the type constant its entry is built for
_TYPE_NAMES = {kabi.KQ_Q4_K: "FC_KQ_Q4_K", kabi.KQ_Q5_K: "FC_KQ_Q5_K", kabi.KQ_Q6_K: "FC_KQ_Q6_K",
               kabi.KQ_Q8_0: "FC_KQ_Q8_0"}
_TYPE_BUILDS = {v: _TYPE_NAMES[t] for t, v in kabi.KQ_TYPE_VARIANTS.items()}


@pytest.mark.parametrize("kernel", kabi.KQ_KERNELS, ids=lambda k: k.family)
def test_kquant_kernel_table_matches_kquant_cu(kernel):
    by_type = kernel.variants == ("",) + tuple(kabi.KQ_TYPE_VARIANTS.values())  # FC_KQ_DEFINE_MMA / _DOWN
    type_only = kernel.variants == tuple(kabi.KQ_TYPE_VARIANTS.values())  # FC_KQ_DEFINE_SHARED_UP / _DOWN
    variant = r"##V##" if by_type or type_only else r"##N##" if kernel.variants != ("",) else ""
    if kernel.typed:
        name = rf"fc_{kernel.family}{variant}_##NAME"
    else:
        name = rf"fc_{kernel.family}##V" if by_type or type_only else rf"fc_{kernel.family}"
    assert _signature(name, KQUANT) == [t if isinstance(t, str) else "segs" for _, t in kernel.params]
    assert set(abi.DTYPE_SUFFIX.values()) == set(re.findall(r"FC_KQ_DEFINE\((\w+), Fc", KQUANT))
    if by_type:  # one entry per weight type, built for it, beside the one for any type
        macro = (r"(?<!#define )FC_KQ_DEFINE_MMA\(NAME, D, (\w*), (\w+)\)" if kernel.typed
                 else r"(?<!#define )FC_KQ_DEFINE_DOWN\((\w*), (\w+)\)")
        built = dict(re.findall(macro, KQUANT))
        assert built == {"": "FC_KQ_ANY", **_TYPE_BUILDS}
    elif type_only:  # one entry per weight type, and none for any type
        macro = (r"(?<!#define )FC_KQ_DEFINE_SHARED_UP\(NAME, D, (\w*), (\w+)\)" if kernel.typed
                 else r"(?<!#define )FC_KQ_DEFINE_SHARED_DOWN\((\w*), (\w+)\)")
        assert dict(re.findall(macro, KQUANT)) == _TYPE_BUILDS
    elif variant:
        macro = "FC_KQ_DEFINE_GEMV" if kernel.family == "kq_gemv" else "FC_KQ_DEFINE_GEMVS"
        assert tuple(re.findall(rf"{macro}\(NAME, D, (\d+)\)", KQUANT)) == kernel.variants


def test_pack_takes_a_struct_by_value():
    segs = kabi.KqSegs()
    segs.nseg, segs.total_rows = 1, 16
    packed = kabi.KQ_MMA.pack(segs, 1, 2, 3, 256, 4, 5)
    assert packed.values[0] is segs and [v.value for v in packed.values[1:]] == [1, 2, 3, 256, 4, 5]
    with pytest.raises(TypeError, match="segs must be a KqSegs"):
        kabi.KQ_MMA.pack(7, 1, 2, 3, 256, 4, 5)
