"""Measured forms: the fastest form of each K-quant product at each token count on one GPU, as
bench/gguf_kernels.py timed it (``--forms-out``), serving in place of the policy's token thresholds where it
measured.

The thresholds (policy.MMA_MIN_TOKENS, MOE_GROUPED_MIN_TOKENS) are one rule for every shape, set on one GPU at
one set of shapes; the fastest form also depends on the shape: at TP 8's shapes on an H100 the staged dp4a form
beat the tensor-core form at 2 tokens on six of the nine linears (q_b 3.71 against 4.75 us, shared gate_up 5.71
against 7.11) and lost on the other three (bench/results/2026-12-07-h100x1-kquant-kernels-tp8-7ba2134.json), where
the rule takes the tensor cores for all. A table holds, per product shape (a linear's segments' types and rows
and its input columns; a MoE's two types, hidden, intermediate and top-k), the form timed fastest at each token
count; a shape or token count it lacks keeps the rule. Each form is tested against the same reference (to the
int8 activations' error), so a table changes which kernel computes a product, not what the product is; ranks on
GPUs of one name read the same table, so a product every rank computes (the replicated q_a / kv_a) stays the
same on each.

Plain data and pure functions (no GPU, no torch): ``Table`` and its JSON round trip (rejecting what it does not
fully understand, naming the file and the field), ``from_rows`` (a benchmark run's rows -> a table), ``forms_for``
(one layer's forms at 1..MAX_TOKENS tokens, the ones the layer cannot run dropped), ``resolve`` (which table
serves for FASTCOMM_GGUF_FORMS on a GPU). Asking it at a layer's loading is fastcomm_vllm.gguf.kquant_vllm's.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Iterable, Mapping

from .. import fields
from ..config import ConfigError
from . import policy

FORMAT = "fastcomm-kquant-forms"   # tells this file from any other JSON (a benchmark's rows, a tune cache)
SCHEMA_VERSION = 1
# A form other than the policy's is kept only if it is this much faster: below it the gap may be run-to-run
# noise. Kernels no commit changed (the plugin's, cuBLAS's) timed in three runs on one machine differed by 3.3 %
# at the median and 5.3 % at the 90th percentile of the 36 products (bench/results/2026-12-02-h200x1-s7-gguf-
# kernels-{4b38652,80c24a4,ed349e4}.json).
MARGIN = 0.05
TABLES = Path(__file__).with_name("tables")   # the tables shipped with fastcomm, one a GPU (``shipped``)
NONE = ""   # a token count the table has no form for: the policy's rule serves
TYPE_IDS = {name: t for t, name in policy.NAMES.items()}  # "Q4_K" -> its ggml id, as tables name the types


class FormsError(ConfigError):
    """A forms table that cannot be used as written (unreadable, foreign, from a newer schema, or malformed)."""


@dataclasses.dataclass(frozen=True)
class LinearShape:
    """A linear layer's product as the kernels see it: its segments' ggml types and rows, in output order,
    and its input columns."""
    types: tuple[int, ...]
    rows: tuple[int, ...]
    cols: int

    @classmethod
    def of(cls, segments: Iterable[policy.Segment], cols: int) -> "LinearShape":
        segs = tuple(segments)
        return cls(tuple(s.type for s in segs), tuple(s.rows for s in segs), cols)


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """A MoE layer's routed experts: up's and down's ggml types, hidden and intermediate sizes, experts a token."""
    t13: int
    t2: int
    hidden: int
    inter: int
    topk: int


@dataclasses.dataclass(frozen=True)
class Entry:
    """One product's measured forms: ``forms[n - 1]`` serves n tokens (NONE: the rule); ``op`` names it for a
    reader; ``us``: per token count, (the form's, the policy's form's) GPU us a call where the run gave them."""
    shape: LinearShape | MoeShape
    forms: tuple[str, ...]
    op: str = ""
    us: tuple[tuple[float, float] | None, ...] = (None,) * policy.MAX_TOKENS


@dataclasses.dataclass(frozen=True)
class Table:
    device: str          # the GPU's name its launches planned for (kquant.limits: torch's name of the GPU)
    source: str          # what measured it (the command, the commit, the result file)
    entries: tuple[Entry, ...]
    margin: float = MARGIN

    def forms(self, shape: LinearShape | MoeShape) -> tuple[str, ...] | None:
        return next((e.forms for e in self.entries if e.shape == shape), None)


# ---- from a benchmark run ----------------------------------------------------------------------------------

def pick(times: Mapping[str, float | None], default: str, margin: float = MARGIN) -> str:
    """The form to serve from one row's times (form -> GPU us; None: it could not run): the fastest, unless
    ``default`` (the policy's form) is within ``margin`` of it."""
    ran = {f: us for f, us in times.items() if us is not None}
    if not ran:
        raise ValueError("no form was timed")
    best = min(ran, key=lambda f: (ran[f], f != default))
    if default in ran and ran[best] >= ran[default] * (1 - margin):
        return default
    return best


def from_rows(rows: Iterable[Mapping[str, Any]], shapes: Mapping[str, LinearShape | MoeShape], device: str,
              source: str, margin: float = MARGIN) -> Table:
    """A table from bench/gguf_kernels.py's rows (each: ``op``, ``tokens``, ``default``, ``<form>_us``) and the
    shape of each op (by the row's ``op``): per op, the form ``pick`` takes at each decode token count it ran.
    Rows past MAX_TOKENS (a prefill's) and ops without a shape are left out."""
    found: dict[str, dict[int, tuple[str, float, float]]] = {}
    for r in rows:
        n, op = int(r["tokens"]), r["op"]
        if op not in shapes or not 1 <= n <= policy.MAX_TOKENS:
            continue
        names = policy.FORMS_MOE if isinstance(shapes[op], MoeShape) else policy.FORMS_LINEAR
        times = {f: r.get(f"{f}_us") for f in names}
        form = pick(times, r["default"], margin)
        found.setdefault(op, {})[n] = (form, times[form], times.get(r["default"]))
    entries = []
    for op, by_n in found.items():
        forms = tuple(by_n[n][0] if n in by_n else NONE for n in range(1, policy.MAX_TOKENS + 1))
        us = tuple((by_n[n][1], by_n[n][2]) if n in by_n and by_n[n][2] is not None else None
                   for n in range(1, policy.MAX_TOKENS + 1))
        entries.append(Entry(shapes[op], forms, op, us))
    return Table(device, source, tuple(entries), margin)


# ---- one layer's forms ------------------------------------------------------------------------------------

def forms_for(table: Table | None, shape: LinearShape | MoeShape, *, tensor_cores: bool,
              mma: bool = True, staged_fits=None) -> tuple[str, ...]:
    """The forms a layer of ``shape`` serves 1..MAX_TOKENS tokens with (NONE where the rule does): the table's,
    less those it may not or cannot run: a tensor-core form without ``tensor_cores`` (FASTCOMM_GGUF_KERNELS=dp4a)
    or where the weight's segments do not allow it (a linear's ``mma``: policy.mma_ok), a grouped MoE form its
    route table cannot hold (policy.moe_form_error), the staged MoE form where ``staged_fits(tokens)`` says its
    stage exceeds a block (None: not asked, as on a CPU rank, which runs no kernel)."""
    measured = table.forms(shape) if table is not None else None
    if measured is None:
        return (NONE,) * policy.MAX_TOKENS
    out = []
    for n, form in enumerate(measured, start=1):
        if isinstance(shape, LinearShape):
            ok = form != "mma" or (tensor_cores and mma)
        else:
            grouped = form in ("grouped", "shared")
            ok = (not grouped or (tensor_cores and policy.moe_form_error(form, n, shape.topk, shape.hidden,
                                                                           shape.inter) is None)) \
                and (form != "staged" or staged_fits is None or staged_fits(n))
        out.append(form if ok else NONE)
    return tuple(out)


# ---- which table ------------------------------------------------------------------------------------------

AUTO, OFF = "auto", "none"   # FASTCOMM_GGUF_FORMS: this GPU's table (measured here, else shipped), none, a file
MACHINE_DIR = "kquant-forms"  # under FASTCOMM_CACHE_DIR: the tables measured on this machine (``machine_path``)


def file_name(device: str) -> str:
    """A table's file name for a GPU of that name (letters and digits kept, the rest '_')."""
    return "".join(c if c.isalnum() else "_" for c in device).strip("_") + ".json"


def machine_path(cache_dir: str | Path, device: str) -> Path:
    """Where ``gguf_kernels --save-forms`` writes this machine's table for ``device``, and ``auto`` reads it."""
    return Path(cache_dir).expanduser() / MACHINE_DIR / file_name(device)


def resolve(setting: str, device: str, tables: Iterable[Table] | None = None,
            cache_dir: str | Path | None = None) -> Table | None:
    """The table that serves on ``device`` (a GPU's name) for FASTCOMM_GGUF_FORMS=``setting``: for ``auto`` the
    one measured on this machine for a GPU of that name (``machine_path`` under ``cache_dir``), else the one of
    ``tables`` (None: the shipped ones) for it; for ``none`` none; else the file ``setting`` names, wherever it
    was measured. A machine's table that cannot be read is left out with a warning (nobody named it), a named
    file's or a shipped one's raises FormsError."""
    if setting == OFF:
        return None
    if setting != AUTO:
        return load(setting)
    if cache_dir is not None:
        path = machine_path(cache_dir, device)
        if path.is_file():
            try:
                return load(path)
            except FormsError as e:
                logging.getLogger("fastcomm").warning("fastcomm: %s; this machine's forms table is left out", e)
    return next((t for t in (shipped() if tables is None else tables) if t.device == device), None)


def describe(setting: str, tables: Iterable[Table] | None = None) -> str:
    """One line on which forms serve for FASTCOMM_GGUF_FORMS=``setting``, on whatever GPU (the launcher of a
    server asks no GPU: the workers pick the table by theirs)."""
    if setting == OFF:
        return "the token thresholds alone (FASTCOMM_GGUF_FORMS=none)"
    if setting != AUTO:
        return f"the forms table {setting} where it measured, the thresholds elsewhere"
    names = ", ".join(t.device for t in (shipped() if tables is None else tables)) or "none"
    return (f"the forms table for the GPU's name where it measured (one made on this machine by `python -m "
            f"fastcomm_bench.gguf_kernels --tp N --tokens 1,2,3,4,5,6,7,8 --save-forms`, else a shipped one: "
            f"{names}), else the token thresholds")


def shipped() -> tuple[Table, ...]:
    """The tables in fastcomm/kquant/tables/ (a malformed one raises FormsError: it ships with the code)."""
    return tuple(load(p) for p in sorted(TABLES.glob("*.json")))


# ---- JSON ---------------------------------------------------------------------------------------------------

def to_json(table: Table) -> dict:
    def entry(e: Entry) -> dict:
        s = e.shape
        if isinstance(s, LinearShape):
            head = {"kind": "linear", "types": [policy.NAMES[t] for t in s.types], "rows": list(s.rows),
                    "cols": s.cols}
        else:
            head = {"kind": "moe", "types": [policy.NAMES[s.t13], policy.NAMES[s.t2]], "hidden": s.hidden,
                    "inter": s.inter, "topk": s.topk}
        forms = {}
        for n, form in enumerate(e.forms, start=1):
            if form == NONE:
                continue
            forms[str(n)] = {"form": form}
            if n <= len(e.us) and e.us[n - 1] is not None:
                forms[str(n)].update(us=e.us[n - 1][0], policy_us=e.us[n - 1][1])
        return {"op": e.op, **head, "forms": forms}

    return {"format": FORMAT, "schema": SCHEMA_VERSION, "device": table.device, "source": table.source,
            "margin": table.margin, "entries": [entry(e) for e in table.entries]}


def _types(data: dict, where: str) -> tuple[int, ...]:
    name, names = fields.get(data, "types", where)
    if not isinstance(names, list) or not names or any(n not in TYPE_IDS for n in names):
        raise fields.BadField(f"field '{name}' must be a list of {', '.join(TYPE_IDS)}, got {names!r}")
    return tuple(TYPE_IDS[n] for n in names)


def _entry(data: Any, where: str) -> Entry:
    fields.need_obj(data, where)
    kind = fields.string(data, "kind", where)
    types = _types(data, where)
    if kind == "linear":
        name, rows = fields.get(data, "rows", where)
        if not isinstance(rows, list) or len(rows) != len(types) or \
                any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in rows):
            raise fields.BadField(f"field '{name}' must be a positive row count per type, got {rows!r}")
        shape = LinearShape(types, tuple(rows), fields.integer(data, "cols", where, lo=1))
        names = policy.FORMS_LINEAR
    elif kind == "moe":
        if len(types) != 2:
            raise fields.BadField(f"field '{where}.types': a MoE has two (up's, down's), got {data['types']!r}")
        shape = MoeShape(types[0], types[1], *(fields.integer(data, k, where, lo=1) for k in ("hidden", "inter", "topk")))
        names = policy.FORMS_MOE
    else:
        raise fields.BadField(f"field '{where}.kind' must be 'linear' or 'moe', got {kind!r}")
    name, forms = fields.get(data, "forms", where)
    fields.need_obj(forms, name)
    out, us = [NONE] * policy.MAX_TOKENS, [None] * policy.MAX_TOKENS
    for key, value in forms.items():
        at = f"{name}.{key}"
        if not key.isdigit() or not 1 <= int(key) <= policy.MAX_TOKENS:
            raise fields.BadField(f"field '{at}': a token count 1-{policy.MAX_TOKENS} is a form's key")
        fields.need_obj(value, at)
        form = fields.string(value, "form", at)
        if form not in names:
            raise fields.BadField(f"field '{at}.form': {form!r} is not one of {', '.join(names)}")
        out[int(key) - 1] = form
        if isinstance(value.get("us"), (int, float)) and isinstance(value.get("policy_us"), (int, float)):
            us[int(key) - 1] = (float(value["us"]), float(value["policy_us"]))
    op = data.get("op", "")
    return Entry(shape, tuple(out), op if isinstance(op, str) else "", tuple(us))


def from_json(data: Any, where: str = "forms table") -> Table:
    """The table ``data`` holds; FormsError naming ``where`` and the problem otherwise."""
    try:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise fields.BadField(f"not a {FORMAT} file (no \"format\": \"{FORMAT}\" marker)")
        schema = fields.integer(data, "schema", "")
        if schema > SCHEMA_VERSION:
            raise fields.BadField(f"schema {schema} is newer than this fastcomm's {SCHEMA_VERSION}")
        name, entries = fields.get(data, "entries", "")
        if not isinstance(entries, list):
            raise fields.BadField(f"field '{name}' must be a list, got {entries!r}")
        parsed = tuple(_entry(e, f"entries[{i}]") for i, e in enumerate(entries))
        if len({e.shape for e in parsed}) != len(parsed):
            raise fields.BadField("a shape appears twice in entries")
        margin = data.get("margin", MARGIN)
        return Table(fields.string(data, "device", ""), str(data.get("source", "")), parsed,
                     float(margin) if isinstance(margin, (int, float)) else MARGIN)
    except fields.BadField as e:
        raise FormsError(f"{where}: {e}") from None


def load(path: str | Path) -> Table:
    """The table in the file ``path`` (FormsError naming it where it cannot be read or used)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise FormsError(f"{path}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise FormsError(f"{path}: not JSON ({e})") from None
    return from_json(data, str(path))


def dump(table: Table, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_json(table), indent=1) + "\n")
