"""Can this input run on fastcomm at all? A reason string when not (the same on every rank), else None."""
from __future__ import annotations

import dataclasses
import enum

from ..abi import ALIGN, FTS_K, FUSED_THREADS, FUSED_VARIANTS, PACKET_PAYLOAD
from .launch import fused_two_shot_slot_bytes, packets_for, two_shot_cut

SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
DTYPE_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
FUSED_MAX_ROW_BYTES = FUSED_THREADS * max(FUSED_VARIANTS) * PACKET_PAYLOAD


def check_tensor(*, is_cuda: bool, device_index: int | None, ws_device_index: int, dtype: str,
                 contiguous: bool, data_ptr: int, nbytes: int, max_bytes: int) -> str | None:
    """Why this tensor cannot go through fastcomm, or None if it can."""
    if not is_cuda:
        return "tensor is not on a CUDA device"
    if device_index != ws_device_index:
        return f"tensor is on cuda:{device_index} but the workspace is on cuda:{ws_device_index}"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not supported (bfloat16, float16, float32)"
    if not contiguous:
        return "tensor is not contiguous"
    if data_ptr % ALIGN:
        return f"tensor data is not {ALIGN}-byte aligned (storage offset?)"
    if nbytes > max_bytes:
        return f"message of {nbytes} bytes exceeds the workspace maximum of {max_bytes} bytes"
    return None


class FusedWhy(enum.Enum):
    """Why the one-shot fused op refuses an input. Callers branch on this, never on the message's text."""
    EMPTY = "empty"              # no token or no column
    ROW_TOO_LONG = "row"         # one row is longer than the kernel covers, at any token count
    ABOVE_LIMIT = "limit"        # the whole input is above the byte limit it was checked against


@dataclasses.dataclass(frozen=True)
class FusedRefusal:
    code: FusedWhy
    message: str  # one line for the user

    def __str__(self) -> str:
        return self.message


def check_fused(*, tokens: int, hidden: int, elem_size: int, one_shot_max_bytes: int) -> FusedRefusal | None:
    """Why the fused all-reduce + RMSNorm cannot run, or None. It rides on the one-shot buffers."""
    if hidden <= 0 or tokens <= 0:
        return FusedRefusal(FusedWhy.EMPTY, "empty input")
    row_bytes = packets_for(hidden * elem_size) * PACKET_PAYLOAD
    if row_bytes > FUSED_MAX_ROW_BYTES:
        return FusedRefusal(FusedWhy.ROW_TOO_LONG, f"a row of {hidden} elements ({row_bytes} bytes) exceeds the "
                                                   f"fused kernel's {FUSED_MAX_ROW_BYTES} bytes")
    if tokens * row_bytes > one_shot_max_bytes:
        return FusedRefusal(FusedWhy.ABOVE_LIMIT,
                            f"{tokens} tokens x {hidden} ({tokens * row_bytes} bytes) is above the fused op's limit "
                            f"of {one_shot_max_bytes} bytes here (routing: the one-shot's range at this world size "
                            "and transport; otherwise the one-shot buffers)")
    return None


def check_fused_two_shot(*, tokens: int, hidden: int, elem_size: int, world: int, host: bool,
                         slot_bytes: int) -> str | None:
    """Why fused_two_shot.cuh cannot run this input, or None. It rides on the one-shot's Lamport slots
    (``slot_bytes`` each, layout.GroupLayout.lp_slot)."""
    if hidden <= 0 or tokens <= 0:
        return "empty input"
    if world < 2:
        return "the fused two-shot needs at least 2 ranks"
    cut = two_shot_cut(hidden, elem_size, world)
    if not all(cut.part_vectors):
        # Every rank must own a part: the clears' safety argument needs each rank to wait for every peer.
        return f"a row of {hidden} elements is too narrow to give each of {world} ranks a 16-byte part"
    if cut.positions > FTS_K * FUSED_THREADS:
        return (f"a row of {hidden} elements ({cut.positions} vectors) exceeds the fused two-shot's "
                f"{FTS_K * FUSED_THREADS} vectors")
    need = fused_two_shot_slot_bytes(tokens, hidden, elem_size, world, host)
    if need > slot_bytes:
        return (f"{tokens} tokens x {hidden} needs {need} bytes per slot, above the one-shot buffers' {slot_bytes} "
                "(FASTCOMM_ONE_SHOT_MAX_BYTES)")
    return None
