"""The K-quant decode kernels on torch tensors: every launch of csrc/kquant/ (the unit "kquant").

Launches go on the current stream, so CUDA-graph capture records them. What runs is policy.py's answer;
this module adds only what needs the device: its limits (or, under the test switch FASTCOMM_TEST_DEVICE_LIMITS,
an emulated GPU's), the kernels' registers and static shared memory, and the launch itself.
"""
from __future__ import annotations

import dataclasses
import functools

from . import abi, settings
from .policy import (EMULATED, dependent_launch, Limits, MAX_TOKENS, MMA_MIN_TOKENS, MOE_GROUPED_MIN_TOKENS, MOE_SHARED_WARPS,
                     MOE_STAGED, PER_PAIR_FORMS, QUANTIZE_THREADS, Segment, chunk_rows, decode_tokens_ok, gemv_variant,
                     linear_form, mma_ok, mma_ring_bytes, mma_smem, mma_variant, mma_warps, moe_call_tokens, moe_form,
                     moe_form_error, moe_shared_smem, moe_stage_bytes, resident_blocks, stage_bytes, staged_grid,
                     tiles, weights_aligned)

# ---- launching ------------------------------------------------------------------------------------------

_MAX_DYNAMIC_SMEM_ATTR = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def _launch(device: int, kernel: abi.Kernel, dtype: str | None, grid: tuple[int, int], block: int, stream: int,
            args: tuple, variant: str = "", smem: int = 0, prefetches: bool = False, pdl: bool = True) -> None:
    """A kernel of csrc/kquant/kquant.cu; ``prefetches``: it has work to do before it waits for the kernel before it
    (the dense mma form's first weight stages), and launches as a dependent where ``dependent_launch`` says
    (``pdl``: FASTCOMM_GGUF_PDL)."""
    packed = kernel.pack(*args)
    symbol = kernel.symbol(dtype, variant)  # an untyped kernel's symbol ignores the dtype
    fn = _smem_function(device, symbol) if smem else _function(device, symbol)
    if dependent_launch(_device(device).major, pdl, prefetches):
        from ..runtime import launch_ex

        launch_ex.launch_dependent(fn, grid, block, smem, stream, packed.address)
        return
    from cupy_backends.cuda.api import driver

    driver.launchKernel(fn, grid[0], grid[1], 1, block, 1, 1, smem, stream, packed.address, 0)


@functools.lru_cache(maxsize=None)
def _function(device: int, symbol: str) -> int:
    from ..config import read
    from ..runtime import jit

    return jit.function(device, read("FASTCOMM_CACHE_DIR"), symbol, unit="kquant")


@functools.lru_cache(maxsize=None)
def _smem_function(device: int, symbol: str) -> int:
    """``_function``, allowed the device's opt-in dynamic shared memory (above 48 KB): whatever kernel a launch
    gives dynamic shared memory to (the staged activations, the mma forms' rings) may need more than 48 KB."""
    from cupy_backends.cuda.api import driver

    fn = _function(device, symbol)
    driver.funcSetAttribute(fn, _MAX_DYNAMIC_SMEM_ATTR, _device(device).smem_per_block - _static_smem(fn))
    return fn


def _static_smem(fn: int) -> int:
    from cupy_backends.cuda.api import driver

    return driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn)


@functools.lru_cache(maxsize=None)
def _resident(device: int, symbol: str, ring: int) -> tuple[int, ...]:
    """Blocks of 1 .. KQ_MMA_WARPS warps (a ring of ``ring`` bytes a warp: mma_smem) one SM of ``device`` holds,
    from its limits (``_device``) and the kernel's registers and static shared memory. Computed, not asked of the
    driver's occupancy query: under emulated limits the query would answer for the GPU in hand."""
    regs, static = _resources(device, symbol)
    return tuple(resident_blocks(_device(device), w, mma_smem(w, ring), static, regs)
                 for w in range(1, abi.KQ_MMA_WARPS + 1))


def _resources(device: int, symbol: str) -> tuple[int, int]:
    """A kernel's registers a thread and static shared memory, which with its launch decide its residency."""
    from cupy_backends.cuda.api import driver

    fn = _smem_function(device, symbol)
    return driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_NUM_REGS, fn), _static_smem(fn)


@functools.lru_cache(maxsize=None)
def _staged_resident(device: int, symbol: str, smem: int) -> int:
    """Blocks of a staged kernel (KQ_STAGED_THREADS, ``smem`` bytes of stage) one SM of ``device`` holds, from
    its limits (``_device``: an emulated GPU's under the test switch) and the kernel's registers."""
    regs, static = _resources(device, symbol)
    return resident_blocks(_device(device), abi.KQ_STAGED_THREADS // 32, smem, static, regs)


def _staged_grid(device: int, kernel: abi.Kernel, dtype: str, items: int, smem: int, variant: str = "") -> int:
    return staged_grid(items, _device(device).sms, _staged_resident(device, kernel.symbol(dtype, variant), smem))


def _fits(device: int, what: str, smem: int) -> None:
    """Refuse a launch whose block needs more shared memory than the device (or the emulated one) gives."""
    limits = _device(device)
    if smem > limits.smem_per_block:
        raise ValueError(f"{what} needs {smem} bytes of shared memory a block; {limits.name} gives "
                         f"{limits.smem_per_block}")


def launch_warps(dev: int, kernel: abi.Kernel, dtype: str | None, types, cols: int, busy_tiles: int,
                 moe: bool = False) -> int:
    """Warps a tile an mma-form launch takes on ``dev`` (``mma_warps`` over the device's limits and the entry's
    residency): what the benchmark reports per product."""
    return _warps(dev, kernel.symbol(dtype, mma_variant(types, moe)), mma_ring_bytes(types), cols, busy_tiles)


def _warps(dev: int, symbol: str, ring: int, cols: int, busy_tiles: int) -> int:
    return mma_warps(cols, busy_tiles, _device(dev).sms, _resident(dev, symbol, ring))


def _mma_launch(dev: int, kernel: abi.Kernel, dtype: str | None, tiles_x: int, grid_y: int, busy_tiles: int,
                cols: int, types, stream: int, args: tuple, warps: int | None = None, moe: bool = False,
                pdl: bool = True) -> None:
    """An mma-form launch: the entry ``mma_variant`` picks, warps a tile from the occupancy of its symbol (or as
    given), a ring per warp; the dense form as a dependent launch (its first weight stages before its wait; the
    grouped MoE's blocks wait for the routes before they know whether their expert has work)."""
    ring = mma_ring_bytes(types)
    variant = mma_variant(types, moe)
    warps = warps or _warps(dev, kernel.symbol(dtype, variant), ring, cols, busy_tiles)
    smem = mma_smem(warps, ring)
    _fits(dev, f"the mma form at {warps} warps a tile", smem)
    _launch(dev, kernel, dtype, (tiles_x, grid_y), 32 * warps, stream, args, variant=variant, smem=smem,
            prefetches=not moe, pdl=pdl)


def _shared_launch(dev: int, kernel: abi.Kernel, dtype: str | None, rows: int, grid_y: int, t: int, stream: int,
                   args: tuple, warps: int) -> None:
    """A shared-form launch: ``warps`` tiles a block, the entry built for weight type ``t``, ``grid_y`` rows of
    blocks (the grouped MoE's busy experts: kq_mma_moe)."""
    if warps not in (1, 2, 4, 8):  # kq_xshare splits a stage's 128 operand pieces evenly over the block
        raise ValueError(f"the shared form takes 1, 2, 4 or 8 warps a block (got {warps})")
    _fits(dev, f"the shared form at {warps} warps a block", moe_shared_smem([t], warps))
    _launch(dev, kernel, dtype, ((tiles(rows) + warps - 1) // warps, grid_y), 32 * warps, stream, args,
            variant=abi.KQ_TYPE_VARIANTS[t], smem=moe_shared_smem([t], warps))


@functools.lru_cache(maxsize=None)
def _device(device: int) -> Limits:
    """The limits the launches plan for: the device's own, or under FASTCOMM_TEST_DEVICE_LIMITS (test mode)
    another GPU's (its SMs and shared memory; the device's own compute capability, which says what it can run)."""
    import torch
    from cupy.cuda import runtime

    p = torch.cuda.get_device_properties(device)
    emulate = settings.read_device_limits()
    if emulate:
        return dataclasses.replace(EMULATED[emulate], major=p.major)
    blocks = runtime.deviceGetAttribute(runtime.cudaDevAttrMaxBlocksPerMultiprocessor, device)
    return Limits(p.name, p.multi_processor_count, int(p.shared_memory_per_block_optin),
                  int(p.shared_memory_per_multiprocessor), int(p.regs_per_multiprocessor),
                  int(p.max_threads_per_multi_processor), int(blocks), p.major)


def limits(device: int) -> Limits:
    """The limits this process's launches on ``device`` plan for (``_device``)."""
    return _device(device)


def forget_limits() -> None:
    """Read the limits again at the next launch (a test that switches FASTCOMM_TEST_DEVICE_LIMITS)."""
    for cached in (_device, _resident, _staged_resident, _smem_function):
        cached.cache_clear()


def staged_fits(device: int, rows: int, cols: int) -> bool:
    return stage_bytes(rows, cols) <= _device(device).smem_per_block


@functools.lru_cache(maxsize=4096)
def _segs_table(base: int, stride: int, segments: tuple[Segment, ...]) -> abi.KqSegs:
    """A weight's segment table, built once per (weight, segments): a layer's eager calls (the LM head runs
    outside vLLM's graphs) reuse it. Nothing in it goes stale: it holds only the address and the layout."""
    table = abi.KqSegs()
    col = 0
    for i, s in enumerate(segments):
        table.s[i] = abi.KqSeg(base + s.start * stride, stride, s.type, s.rows, col, col)
        col += s.rows
    table.nseg, table.total_rows = len(segments), col
    return table


def _stream(t) -> int:
    import torch

    return torch.cuda.current_stream(t.device).cuda_stream


def _dt(x) -> str:
    return str(x.dtype).split(".")[-1]


def quantize(x, silu: bool = False, mma: bool = False):
    """int8 chunks (as int32 words) and (scale, sum) pairs of ``x`` [n, cols] (rows 16-byte aligned), or with
    ``silu`` of silu(gate) * up for rows [gate | up] of 2 cols; ``mma``: in the order the tensor-core forms
    read (cols a multiple of 256)."""
    import torch

    n, width = x.shape
    cols = width // 2 if silu else width
    chunks = cols // abi.KQ_CHUNK
    xq = torch.empty(n * chunks * 8, dtype=torch.int32, device=x.device)
    xds = torch.empty(n * chunks, 2, dtype=torch.float32, device=x.device)
    total = n * chunks
    _launch(x.device.index, abi.KQ_QUANTIZE_SILU if silu else abi.KQ_QUANTIZE, _dt(x),
            ((total + QUANTIZE_THREADS - 1) // QUANTIZE_THREADS, 1), QUANTIZE_THREADS, _stream(x),
            (x.data_ptr(), n, cols, x.stride(0), xq.data_ptr(), xds.data_ptr(), int(mma)))
    return xq, xds


def _aligned(x):
    """x as rows the quantize kernel reads (contiguous, 16-byte aligned rows)."""
    if x.stride(-1) != 1 or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        x = x.contiguous()
    return x


def _require_aligned(*pointers: int) -> None:
    """The kernels read Q4_K / Q5_K rows by 16 bytes: refuse a weight off that alignment by its address."""
    if not weights_aligned(*pointers):
        at = ", ".join(f"{p:#x}" for p in pointers)
        raise ValueError(f"the K-quant kernels need 16-byte aligned weights (at {at})")


def _out(out, rows: int, cols: int, x):
    """``out`` checked as a contiguous [rows, cols] of x's dtype on x's device (the kernels write it densely),
    or a new one."""
    import torch

    if out is None:
        return torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (rows, cols) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} [{rows}, {cols}] on {x.device} (got {out.dtype} "
                         f"{list(out.shape)} on {out.device})")
    return out


def linear(x, qweight, segments: tuple[Segment, ...], form: str | None = None, tensor_cores: bool = True,
           mma_min: int = MMA_MIN_TOKENS, warps: int | None = None, pdl: bool = True, out=None):
    """x [n, cols] (n <= 8) times the segments' rows of ``qweight`` (uint8 [rows, row_stride]): [n, sum rows].
    ``form``: one of FORMS_LINEAR (None: ``linear_form``'s choice, the mma form only with ``tensor_cores``,
    from ``mma_min`` tokens); ``warps``: the mma form's warps a tile (None: ``mma_warps``'); ``pdl``: the mma form
    may launch as a dependent of its quantize launch (FASTCOMM_GGUF_PDL, ``dependent_launch``); ``out``: where
    to write the product (``_out``), e.g. rows of a chunked product's output."""
    _require_aligned(qweight.data_ptr())
    if not decode_tokens_ok(x.shape[0]):
        raise ValueError(f"linear takes 1-{MAX_TOKENS} tokens (got {x.shape[0]}; linear_chunks takes any)")
    x = _aligned(x)
    n, cols = x.shape
    dev, dt, stream = x.device.index, _dt(x), _stream(x)
    table = _segs_table(qweight.data_ptr(), qweight.stride(0) * qweight.element_size(), segments)
    total = table.total_rows
    out = _out(out, n, total, x)
    fits = staged_fits(dev, n, cols)
    form = form or linear_form(n, tensor_cores and mma_ok(segments, cols), fits, mma_min, cols)
    if form == "mma":
        if not mma_ok(segments, cols):
            raise ValueError(f"the mma form cannot read these segments ({segments}, {cols} columns)")
        xq, xds = quantize(x, mma=True)
        _mma_launch(dev, abi.KQ_MMA, dt, tiles(total), 1, tiles(total), cols, [s.type for s in segments], stream,
                    (table, xq.data_ptr(), xds.data_ptr(), n, cols, out.data_ptr(), total), warps, pdl=pdl)
        return out
    variant = str(gemv_variant(n))
    if form == "staged" and fits:
        smem = stage_bytes(n, cols)
        _launch(dev, abi.KQ_GEMVS, dt, (_staged_grid(dev, abi.KQ_GEMVS, dt, total, smem, variant), 1),
                abi.KQ_STAGED_THREADS, stream, (table, x.data_ptr(), n, cols, x.stride(0), out.data_ptr(), total),
                variant=variant, smem=smem)
        return out
    xq, xds = quantize(x)
    _launch(dev, abi.KQ_GEMV, dt, ((total + abi.KQ_ROWS_PER_BLOCK - 1) // abi.KQ_ROWS_PER_BLOCK, 1),
            abi.KQ_THREADS, stream, (table, xq.data_ptr(), xds.data_ptr(), n, cols, out.data_ptr(), total),
            variant=variant)
    return out


def moe(x, w13, w2, topk_weights, topk_ids, t13: int, t2: int, activation, silu: bool = False,
        form: str | None = None, tensor_cores: bool = True, grouped_min: int = MOE_GROUPED_MIN_TOKENS,
        staged: bool = MOE_STAGED, shared_warps: int = MOE_SHARED_WARPS, out=None):
    """The routed experts of 1-8 tokens (the grouped forms: up to KQ_MAX_PAIRS pairs, ``moe_call_tokens``):
    x [T, hidden], w13 [E, 2 inter, row13], w2 [E, hidden, row2] (uint8
    blocks); returns [T, hidden], each token's experts summed in their top-k order, router weights applied.
    ``activation`` maps [pairs, 2 inter] to [pairs, inter]; ``silu``: it is vLLM's silu_and_mul, which the
    activations' quantize launch then applies itself (``activation`` is not called). ``form``: one of FORMS_MOE
    (None: ``moe_form``'s, the grouped form only with ``tensor_cores``, from ``grouped_min`` tokens, below it the
    staged form where ``staged`` and it fits, FASTCOMM_GGUF_MOE_STAGED); a form that cannot serve the shapes raises
    ValueError (``moe_form_error`` or the device's shared memory says why). ``shared_warps``: the shared form's
    tiles a block (1, 2, 4 or 8; the benchmark times each); ``out``: where to write the sums (``_out``)."""
    import torch

    _require_aligned(w13.data_ptr(), w2.data_ptr())
    x = _aligned(x)
    tokens, hidden = x.shape
    topk = topk_ids.shape[1]
    pairs = tokens * topk
    experts, rows13 = w13.shape[0], w13.shape[1]
    inter = rows13 // 2
    dev, stage = x.device.index, moe_stage_bytes(tokens, topk, hidden, inter)
    if form is None:  # past MAX_TOKENS the refusal below comes before the device is asked anything
        smem = _device(dev).smem_per_block if staged and tokens <= MAX_TOKENS else None
        form = moe_form(tokens, topk, hidden, inter, tensor_cores, grouped_min, staged, smem)
    if tokens < 1 or (tokens > MAX_TOKENS and form in PER_PAIR_FORMS):
        raise ValueError(f"moe takes 1-{MAX_TOKENS} tokens in the {form} form (got {tokens}; moe_chunks takes any)")
    error = moe_form_error(form, tokens, topk, hidden, inter)
    if error:
        raise ValueError(f"{error} (moe_chunks takes any number of tokens)")
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    dt, stream = _dt(x), _stream(x)
    e13, r13 = w13.stride(0) * w13.element_size(), w13.stride(1) * w13.element_size()
    e2, r2 = w2.stride(0) * w2.element_size(), w2.stride(1) * w2.element_size()
    if form == "staged":
        _fits(dev, "the staged MoE form", stage)
        return _moe_staged(x, w13, w2, weights, ids, t13, t2, activation, silu, out, (e13, r13, e2, r2))
    busy = min(experts, pairs)  # experts a grouped launch's blocks can find work for: its grid's rows
    grouped, shared = form in ("grouped", "shared"), form == "shared"
    xq, xds = quantize(x, mma=grouped)
    up = torch.empty(pairs, rows13, dtype=x.dtype, device=x.device)
    if shared:
        _shared_launch(dev, abi.KQ_MOE_MMA_UP_SHARED, dt, rows13, busy, t13, stream,
                       (w13.data_ptr(), e13, r13, t13, rows13, hidden, ids.data_ptr(), topk, pairs, experts,
                        xq.data_ptr(), xds.data_ptr(), up.data_ptr()), shared_warps)
    elif grouped:
        _mma_launch(dev, abi.KQ_MOE_MMA_UP, dt, tiles(rows13), busy, tiles(rows13) * busy, hidden, [t13], stream,
                    (w13.data_ptr(), e13, r13, t13, rows13, hidden, ids.data_ptr(), topk, pairs, experts,
                     xq.data_ptr(), xds.data_ptr(), up.data_ptr()), moe=True)
    else:
        _launch(dev, abi.KQ_MOE_UP, dt, ((rows13 + abi.KQ_ROWS_PER_BLOCK - 1) // abi.KQ_ROWS_PER_BLOCK, pairs),
                abi.KQ_THREADS, stream, (w13.data_ptr(), e13, r13, t13, rows13, hidden, ids.data_ptr(), topk,
                                         xq.data_ptr(), xds.data_ptr(), up.data_ptr()))
    aq, ads = quantize(up, silu=True, mma=grouped) if silu else quantize(_aligned(activation(up)), mma=grouped)
    out = _out(out, tokens, hidden, x)
    if grouped:
        y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
        down = (w2.data_ptr(), e2, r2, t2, hidden, inter, ids.data_ptr(), topk, pairs, experts, aq.data_ptr(),
                ads.data_ptr(), y.data_ptr())
        if shared:
            _shared_launch(dev, abi.KQ_MOE_MMA_DOWN_SHARED, None, hidden, busy, t2, stream, down, shared_warps)
        else:
            _mma_launch(dev, abi.KQ_MOE_MMA_DOWN, None, tiles(hidden), busy, tiles(hidden) * busy, inter, [t2],
                        stream, down, moe=True)
        _launch(dev, abi.KQ_MOE_SUM, dt, ((tokens * hidden + 255) // 256, 1), 256, stream,
                (y.data_ptr(), ids.data_ptr(), weights.data_ptr(), topk, experts, tokens, hidden, out.data_ptr()))
        return out
    _launch(dev, abi.KQ_MOE_DOWN, dt, ((hidden + abi.KQ_ROWS_PER_BLOCK - 1) // abi.KQ_ROWS_PER_BLOCK, tokens),
            abi.KQ_THREADS, stream, (w2.data_ptr(), e2, r2, t2, hidden, inter, ids.data_ptr(), weights.data_ptr(),
                                     topk, aq.data_ptr(), ads.data_ptr(), out.data_ptr()))
    return out


def _moe_staged(x, w13, w2, weights, ids, t13: int, t2: int, activation, silu: bool, out, strides):
    """``moe``'s staged form: up and down, each block quantizing its activations (down: silu(gate) * up where
    ``silu``, as the pairs form's quantize-silu rounds it) into shared memory: two launches."""
    import torch

    (tokens, hidden), topk, rows13 = x.shape, ids.shape[1], w13.shape[1]
    inter, pairs = rows13 // 2, tokens * ids.shape[1]
    e13, r13, e2, r2 = strides
    dt, dev, stream = _dt(x), x.device.index, _stream(x)
    up = torch.empty(pairs, rows13, dtype=x.dtype, device=x.device)
    smem = stage_bytes(tokens, hidden)
    _launch(dev, abi.KQ_MOE_UP_S, dt, (_staged_grid(dev, abi.KQ_MOE_UP_S, dt, pairs * rows13, smem), 1),
            abi.KQ_STAGED_THREADS, stream, (w13.data_ptr(), e13, r13, t13, rows13, hidden, ids.data_ptr(), topk,
                                            tokens, x.data_ptr(), x.stride(0), up.data_ptr()), smem=smem)
    a = up if silu else _aligned(activation(up))
    out = _out(out, tokens, hidden, x)
    smem = stage_bytes(pairs, inter)
    _launch(dev, abi.KQ_MOE_DOWN_S, dt, (_staged_grid(dev, abi.KQ_MOE_DOWN_S, dt, tokens * hidden, smem), 1),
            abi.KQ_STAGED_THREADS, stream, (w2.data_ptr(), e2, r2, t2, hidden, inter, ids.data_ptr(),
                                            weights.data_ptr(), topk, tokens, a.data_ptr(), a.stride(0), int(silu),
                                            out.data_ptr()), smem=smem)
    return out


def linear_chunks(x, qweight, segments: tuple[Segment, ...], **forms):
    """``linear`` for any number of tokens: MAX_TOKENS rows a call (``chunk_rows``) into one output, each call its
    own read of the weight; ``forms`` as ``linear`` takes them. No host sync: a CUDA graph can hold it."""
    x = _aligned(x)
    out = _out(None, x.shape[0], sum(s.rows for s in segments), x)
    for a, b in chunk_rows(x.shape[0]):
        linear(x[a:b], qweight, segments, out=out[a:b], **forms)
    return out


def moe_chunks(x, w13, w2, topk_weights, topk_ids, t13: int, t2: int, activation, **forms):
    """``moe`` for any number of tokens, ``moe_call_tokens`` a call (the grouped form's 32 of top 8; 8 in the
    pairs form) into one output; ``forms`` as ``moe`` takes them (``form`` names one for every call)."""
    import torch

    x = _aligned(x)
    out = _out(None, x.shape[0], x.shape[1], x)
    # the kernels' id and weight types once, not per call (each call's slice of them then needs no copy)
    topk_ids, topk_weights = topk_ids.to(torch.int32).contiguous(), topk_weights.to(torch.float32).contiguous()
    size = moe_call_tokens(topk_ids.shape[1], x.shape[1], w13.shape[1] // 2, forms.get("form"),
                           forms.get("tensor_cores", True), forms.get("grouped_min", MOE_GROUPED_MIN_TOKENS))
    for a, b in chunk_rows(x.shape[0], size):
        moe(x[a:b], w13, w2, topk_weights[a:b], topk_ids[a:b], t13, t2, activation, out=out[a:b], **forms)
    return out


def dequantize(qweight, segments: tuple[Segment, ...], cols: int, dtype):
    """The segments' rows of ``qweight`` (uint8 [rows, row_stride], read in place) as ``dtype``: [sum of their
    rows, cols], each weight as ggml dequantizes it rounded once to the dtype (fc_kq_dequant, one launch)."""
    import torch

    _require_aligned(qweight.data_ptr())
    table = _segs_table(qweight.data_ptr(), qweight.stride(0) * qweight.element_size(), segments)
    out = torch.empty(table.total_rows, cols, dtype=dtype, device=qweight.device)
    threads = table.total_rows * (cols // abi.KQ_CHUNK)  # a chunk of 32 values each
    _launch(qweight.device.index, abi.KQ_DEQUANT, _dt(out), ((threads + 255) // 256, 1), 256, _stream(qweight),
            (table, cols, out.data_ptr()))
    return out
