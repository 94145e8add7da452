"""The tune cache: measured size rules for one machine setup, written by `fastcomm tune` and read at
workspace build (the measuring command is ``fastcomm.commands.tune``).

- plain data: ``Fingerprint`` and ``TuneCache`` (frozen; JSON round-trip that rejects anything it does not
  fully understand, naming the file and the problem);
- pure functions: ``rules_from_measurements`` (timings -> rules) and ``rules_from_file`` (config -> rules).

The cache is never required: without one, or with one tuned elsewhere, workspaces use ``policy.DEFAULT_TABLE``.
Only rank 0 reads it; the workspace broadcasts the verdict so every rank runs the same rules.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .config import Config
from .errors import FastcommError
# A problem inside the data (``from_json`` adds the file name), and the validated reads of the fields.
from .fields import BadField as _Bad, enum as _enum, get as _get, integer as _int, need_obj as _need_obj, \
    string as _str
from .policy import SUPPORTED_DTYPES, Algo, LinkType, PolicyKey, Rule, Transport, lookup_rules

log = logging.getLogger("fastcomm")

SCHEMA_VERSION = 1
FORMAT = "fastcomm-tune"  # marker that tells our file from any other JSON (a bench result, a topo dump)
FILE_NAME = "tune.json"
# fastcomm must beat NCCL by this fraction to be kept: below it the gap is run-to-run noise, and NCCL is the
# safer default (no workspace limits, no extra buffers in the graph).
DEFAULT_MARGIN = 0.03
# Ties go to the first: one-shot has one hop and no intermediate state.
FASTCOMM_ALGOS = (Algo.ONE_SHOT, Algo.TWO_SHOT, Algo.TWO_SHOT_LL, Algo.PULL)  # pull: P2P only (skipped on host)


class TuneCacheError(FastcommError):
    """A tune cache file that cannot be used as written (missing, corrupt, foreign, or from a newer schema)."""




# ---- plain data ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What the timings depend on. A cache whose fingerprint differs from this run's is not used."""

    gpu_name: str
    gpu_count: int      # the world size that was measured
    transport: Transport
    link: LinkType
    cuda: str           # CUDA version torch was built with (the kernels' toolchain)
    fastcomm: str       # package version: kernels change between versions, and so do their timings

    def matches(self, other: "Fingerprint") -> str | None:
        """None if ``other`` is the same machine setup; else which fields differ (self = the cache's)."""
        diffs = []
        for f in dataclasses.fields(self):
            mine, theirs = _plain(getattr(self, f.name)), _plain(getattr(other, f.name))
            if mine != theirs:
                diffs.append(f"{f.name} {mine!r} (cache) != {theirs!r} (here)")
        return "; ".join(diffs) or None

    def to_json(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: Any, where: str = "fingerprint") -> "Fingerprint":
        """Raises ValueError on bad data (``TuneCache.from_json`` turns it into a TuneCacheError naming the file)."""
        _need_obj(data, where)
        return cls(gpu_name=_str(data, "gpu_name", where), gpu_count=_int(data, "gpu_count", where, lo=1),
                   transport=_enum(Transport, _str(data, "transport", where), f"{where}.transport"),
                   link=_enum(LinkType, _str(data, "link", where), f"{where}.link"),
                   cuda=_str(data, "cuda", where), fastcomm=_str(data, "fastcomm", where))


def cuda_version() -> str | None:
    """The CUDA version torch was built with (known without a GPU), or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    return str(torch.version.cuda)


def fingerprint_for(gpu_name: str, world_size: int, transport: Transport, link: LinkType) -> Fingerprint | None:
    """The fingerprint a run on these GPUs would have (``fastcomm topo`` builds it from the probe), or None
    when torch, whose CUDA version is part of it, is not installed."""
    from .version import __version__

    cuda = cuda_version()
    if cuda is None:
        return None
    return Fingerprint(gpu_name=gpu_name, gpu_count=world_size, transport=Transport(transport), link=LinkType(link),
                       cuda=cuda, fastcomm=__version__)


def fingerprint_here(transport: Transport, link: LinkType, world_size: int, device_index: int = 0) -> Fingerprint:
    """This process's fingerprint (touches CUDA through torch; the rest of the module does not)."""
    import torch

    return fingerprint_for(torch.cuda.get_device_name(device_index), world_size, transport, link)


@dataclasses.dataclass(frozen=True)
class TuneCache:
    version: int
    fingerprint: Fingerprint
    table: dict[PolicyKey, tuple[Rule, ...]]
    created: str                                   # ISO 8601, UTC
    measurements: tuple[dict, ...] = ()            # raw rows (size, algo, us, wrong), kept for people

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": self.version,
            "created": self.created,
            "fingerprint": self.fingerprint.to_json(),
            "table": [{"transport": k.transport.value, "link": k.link.value, "world_size": k.world_size,
                       "dtype": k.dtype, "rules": [{"max_bytes": r.max_bytes, "algo": r.algo.value} for r in rules]}
                      for k, rules in self.table.items()],
            "measurements": [dict(m) for m in self.measurements],
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "<data>") -> "TuneCache":
        """Parse and validate; every problem raises ``TuneCacheError`` naming ``source``."""
        try:
            return cls._parse(data)
        except _Bad as e:
            raise TuneCacheError(f"tune cache {source}: {e}; regenerate it with `fastcomm tune`") from None

    @classmethod
    def _parse(cls, data: Any) -> "TuneCache":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise _Bad(f"not a fastcomm tune cache (no \"format\": \"{FORMAT}\" marker)")
        version = _int(data, "version", "")
        if version != SCHEMA_VERSION:
            raise _Bad(f"schema version {version}, this fastcomm reads version {SCHEMA_VERSION}")
        entries = data.get("table")
        if not isinstance(entries, list):
            raise _Bad("missing or ill-typed field 'table' (expected a list)")
        table: dict[PolicyKey, tuple[Rule, ...]] = {}
        for i, entry in enumerate(entries):
            key, rules = _parse_entry(entry, f"table[{i}]")
            if key in table:
                raise _Bad(f"table[{i}] repeats the entry for {_key_text(key)}")
            table[key] = rules
        rows = data.get("measurements", [])
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise _Bad("ill-typed field 'measurements' (expected a list of objects)")
        return cls(version=version, fingerprint=Fingerprint.from_json(data.get("fingerprint")), table=table,
                   created=_str(data, "created", ""), measurements=tuple(rows))

    def save(self, path: Path | str) -> Path:
        """Write atomically: readers (other processes starting a workspace) see the old file or the new one."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_json(), f, indent=1)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


def load(path: Path | str) -> TuneCache:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise TuneCacheError(f"tune cache {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TuneCacheError(f"tune cache {path}: cannot read it ({e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TuneCacheError(f"tune cache {path}: invalid JSON ({e}); regenerate it with `fastcomm tune`") from None
    return TuneCache.from_json(data, source=str(path))


def default_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / FILE_NAME


# ---- validation helpers --------------------------------------------------------------------------------

def _plain(v):
    return v.value if isinstance(v, (Transport, LinkType, Algo)) else v


def _parse_entry(entry: Any, where: str) -> tuple[PolicyKey, tuple[Rule, ...]]:
    _need_obj(entry, where)
    dtype = _str(entry, "dtype", where)
    if dtype not in ("any", *SUPPORTED_DTYPES):
        raise _Bad(f"unknown dtype {dtype!r} at '{where}.dtype' (known: any, {', '.join(SUPPORTED_DTYPES)})")
    key = PolicyKey(_enum(Transport, _str(entry, "transport", where), f"{where}.transport"),
                    _enum(LinkType, _str(entry, "link", where), f"{where}.link"),
                    _int(entry, "world_size", where, lo=0), dtype)
    _, raw = _get(entry, "rules", where)
    if not isinstance(raw, list):
        raise _Bad(f"field '{where}.rules' must be a list, got {raw!r}")
    rules = []
    for j, r in enumerate(raw):
        at = f"{where}.rules[{j}]"
        _need_obj(r, at)
        rule = Rule(_int(r, "max_bytes", at), _enum(Algo, _str(r, "algo", at), f"{at}.algo"))
        if rule.max_bytes <= 0:
            raise _Bad(f"field '{at}.max_bytes' must be positive, got {rule.max_bytes}")
        if rules and rule.max_bytes <= rules[-1].max_bytes:
            # choose_algo takes the first rule that fits, so an unsorted list would hide rules silently.
            raise _Bad(f"rules at '{where}' are not sorted by max_bytes ({rules[-1].max_bytes} then {rule.max_bytes})")
        rules.append(rule)
    return key, tuple(rules)


def _key_text(k: PolicyKey) -> str:
    return f"transport {k.transport.value}, link {k.link.value}, world size {k.world_size}, dtype {k.dtype}"


# ---- pure functions ------------------------------------------------------------------------------------

def rules_from_file(config: Config, fingerprint: Fingerprint) -> tuple[tuple[Rule, ...] | None, str]:
    """Rules from the tune cache for this run, or None (use the defaults) and why.

    An explicit ``config.tune_file`` must be a valid cache (errors raise); a file at the default path is only
    a hint, so a bad one is logged and skipped: the cache is never required. A cache tuned on another setup
    (fingerprint differs) is never used.
    """
    explicit = config.tune_file is not None
    path = Path(config.tune_file) if explicit else default_path(config.cache_dir)
    if not explicit and not path.exists():
        return None, f"no tune cache (FASTCOMM_TUNE_FILE unset, none at {path}); default policy"
    try:
        cache = load(path)
    except TuneCacheError as e:
        if explicit:
            raise
        log.warning("fastcomm: ignoring %s; using the default policy", e)
        return None, f"{e}; default policy"
    diff = cache.fingerprint.matches(fingerprint)
    if diff is not None:
        reason = f"tune cache {path} was measured on another setup ({diff}); default policy"
        log.warning("fastcomm: %s. Re-run `fastcomm tune` here to use measured crossovers.", reason)
        return None, reason
    # The fingerprint matched, so an entry for this run's key (or its fallbacks) is expected; report its absence
    # rather than letting lookup_rules' empty answer read as "always NCCL".
    fp = fingerprint
    if not any(PolicyKey(fp.transport, lk, ws) in cache.table for lk in (fp.link, LinkType.UNKNOWN)
               for ws in (fp.gpu_count, 0)):
        reason = f"tune cache {path} has no entry for transport {fp.transport.value}, link {fp.link.value}, " \
                 f"world size {fp.gpu_count}; default policy"
        log.warning("fastcomm: %s", reason)
        return None, reason
    rules = lookup_rules(cache.table, fp.transport, fp.link, fp.gpu_count)
    return rules, f"tuned rules from {path} (created {cache.created})"


def rules_from_measurements(rows: Iterable[Mapping], sizes: Sequence[int], *,
                            margin: float = DEFAULT_MARGIN) -> tuple[Rule, ...]:
    """Rules from graph-mode timings: rows of {"size", "algo" (an Algo value), "us"}.

    Per size the faster fastcomm algorithm is picked; fastcomm serves every size up to the largest one where it
    beats NCCL by ``margin`` (NCCL beyond); consecutive sizes with the same algorithm merge into one rule whose
    max_bytes is the largest size of the run. A dip below NCCL in the middle is kept as fastcomm: a table with
    a hole in it would mostly be fitting noise. Sizes with no fastcomm timing (over a buffer limit) are NCCL.
    """
    us: dict[tuple[int, Algo], float] = {}
    for r in rows:
        us[(int(r["size"]), Algo(r["algo"]))] = float(r["us"])
    sizes = sorted(set(sizes))
    best: list[Algo | None] = []
    last_win = -1
    for i, s in enumerate(sizes):
        if (s, Algo.NCCL) not in us:
            raise ValueError(f"no NCCL timing for size {s}: cannot place the crossover")
        timed = [(us[(s, a)], k, a) for k, a in enumerate(FASTCOMM_ALGOS) if (s, a) in us]
        t, _, algo = min(timed) if timed else (None, None, None)
        best.append(algo)
        if t is not None and t < us[(s, Algo.NCCL)] * (1.0 - margin):
            last_win = i
    rules: list[Rule] = []
    for s, algo in zip(sizes[:last_win + 1], best[:last_win + 1]):
        algo = algo or Algo.NCCL
        if rules and rules[-1].algo is algo:
            rules[-1] = Rule(s, algo)
        else:
            rules.append(Rule(s, algo))
    return tuple(rules)
