"""`fastcomm-serve`: `vllm serve` with fastcomm active.

    fastcomm-serve MODEL [fastcomm-serve options] [any `vllm serve` option ...]

Detects the GPUs and their topology, defaults --tensor-parallel-size to the GPU count, leaves CUDA graphs
on, sets the environment below, and execs `python -m vllm.entrypoints.cli.main serve` with every other
argument exactly as given (argparse's parse_known_args: what is not ours passes through in order). A GGUF
model (a .gguf file, the first shard of a split, or their folder) goes through vllm-gguf-plugin, with
fastcomm's GLM-5 mapping and, for a GLM-5 file carrying its MTP block, MTP speculative decoding on.
Variables already set in your environment are never overridden.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import sys
from typing import Mapping, Sequence

from fastcomm.config import TRANSPORTS, ConfigError

from .gguf.files import looks_like_path

DESCRIPTION = """\
Runs `vllm serve` with fastcomm's all-reduce (the fastcomm vLLM plugin) active. Every argument that is
not one of the options below goes to `vllm serve` unchanged (see `vllm serve --help`)."""

DEFAULTS = """\
Defaults it applies:
  --tensor-parallel-size  the number of visible GPUs, unless you pass -tp / --tensor-parallel-size
  CUDA graphs             left on (it never adds --enforce-eager; fastcomm's gain is largest with graphs)
  FASTCOMM_VLLM=1         and 'fastcomm' added to VLLM_PLUGINS if you restrict plugins with it
  NCCL_P2P_LEVEL=PHB      only when the probe finds P2P working between every pair of the GPUs and the
                          slowest link crosses a CPU root complex (PHB/NODE). NCCL's own default refuses
                          P2P through Intel (and ARM) root complexes and then runs the all-reduces that
                          stay on NCCL (prefill-sized ones, above fastcomm's range) through host shared
                          memory: two PCIe crossings and a copy instead of one direct write. Not set for
                          links across sockets, where P2P is often slower than host memory.

GGUF models (install: pip install -e ".[gguf]" from a fastcomm checkout):
  MODEL                   a .gguf file, the first shard of a split (-00001-of-0000N.gguf), or their folder;
                          every shard must be there
  GLM-5 (glm-dsa)         config (--hf-config-path) and tokenizer (--tokenizer) derived from the file's
                          metadata unless you pass them (a --hf-config-path folder holding a tokenizer is
                          the tokenizer too); served as the file's name, e.g. GLM-5-UD-Q4_K_XL (the path
                          works too; --served-model-name overrides); MTP speculative decoding with the
                          file's MTP block on by default (--no-mtp, --mtp-tokens N); --dry-run says what it
                          chose and why
  on sm_120 (RTX PRO 6000 Blackwell, RTX 50xx; detected, or --capability 12.0)
                          --attention-backend FLASHINFER_MLA_SPARSE_SM120, --dtype bfloat16, --kv-cache-dtype
                          fp8_ds_mla, --block-size 64 (unless you pass them; values that backend cannot take
                          are refused), and a vLLM + FlashInfer pair that cannot run it is refused in one
                          line naming what to install, before anything loads
  other architectures     passed to vllm-gguf-plugin unchanged
"""

VLLM_MAIN = "vllm.entrypoints.cli.main"
CHECKPOINT_FILES = ("config.json", "params.json")  # what vLLM reads a local checkpoint folder's config from
VLLM_HINT = 'pip install -e ".[vllm]" (from a fastcomm checkout)'


class ServeError(Exception):
    """A problem with the request, reported as `fastcomm-serve: error: ...` (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class Options:
    dry_run: bool = False
    gpus: int | None = None
    transport: str | None = None
    fastcomm: bool = True
    fusion: bool = False
    nccl_env: bool = True
    help: bool = False
    version: bool = False
    mtp: bool | None = None           # None: on when a GLM-5 GGUF carries its MTP block
    mtp_tokens: int | None = None     # draft tokens per step (None: 1)
    capability: tuple[int, int] | None = None  # assumed compute capability (None: detected)


@dataclasses.dataclass(frozen=True)
class Launch:
    argv: tuple[str, ...]                   # the exact command
    env: tuple[tuple[str, str, str], ...]   # (name, value, why) that fastcomm-serve sets
    notes: tuple[str, ...]                  # what it decided, and warnings
    gpus: int                               # visible GPUs (detected or --gpus)

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        return {**base, **{name: value for name, value, _ in self.env}}

    def shell(self) -> str:
        assigns = [f"{name}={shlex.quote(value)}" for name, value, _ in self.env]
        return " ".join(assigns + [shlex.quote(a) for a in self.argv])


# ---- parsing --------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line through main's error path, not argparse's usage + exit
        raise ServeError(message)


def _count(value: str) -> int:
    if not re.fullmatch(r"\d+", value):
        raise argparse.ArgumentTypeError(f"expects a number, got {value!r}")
    return int(value)


def _positive(value: str) -> int:
    n = _count(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value!r}")
    return n


def _capability(value: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)\.(\d)", value)
    if m is None:
        raise argparse.ArgumentTypeError(f"expects MAJOR.MINOR such as 12.0, got {value!r}")
    return int(m.group(1)), int(m.group(2))


def parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: vLLM's --gpu-memory-utilization must not read as an abbreviation of --gpus.
    p = _Parser(prog="fastcomm-serve", usage="fastcomm-serve MODEL [fastcomm-serve options] [vllm serve options ...]",
                description=DESCRIPTION, epilog=DEFAULTS, add_help=False, allow_abbrev=False,
                formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=110, max_help_position=30))
    g = p.add_argument_group("fastcomm-serve options")
    g.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    g.add_argument("--version", action="store_true", help="print the versions of fastcomm and of what it runs, and exit")
    g.add_argument("--dry-run", action="store_true", help="print the exact command and environment, do not start vLLM")
    g.add_argument("--gpus", type=_count, metavar="N",
                   help="assume N visible GPUs instead of detecting them (e.g. for --dry-run elsewhere)")
    g.add_argument("--capability", type=_capability, metavar="MAJOR.MINOR",
                   help="assume GPUs of this compute capability instead of detecting it (e.g. 12.0 for RTX PRO 6000 "
                        "Blackwell, with --gpus N for --dry-run elsewhere)")
    g.add_argument("--fastcomm-transport", dest="transport", choices=TRANSPORTS,
                   help="FASTCOMM_TRANSPORT: peer GPU memory (p2p), pinned host memory (host, for GPUs without "
                        "P2P), or the probe's choice (auto)")
    g.add_argument("--fastcomm-fusion", dest="fusion", action="store_true",
                   help="FASTCOMM_VLLM_FUSION=1: also fuse all-reduce + RMSNorm into one fastcomm kernel. Off by "
                        "default until an end-to-end run shows it faster than the all-reduce alone")
    g.add_argument("--no-fastcomm", dest="fastcomm", action="store_false",
                   help="run the same command with FASTCOMM_VLLM=0 (vLLM's own all-reduce; a baseline)")
    g.add_argument("--no-nccl-env", dest="nccl_env", action="store_false", help="do not set the NCCL variables described below")
    g.add_argument("--no-mtp", dest="mtp", action="store_const", const=False,
                   help="GGUF: serve a GLM-5 file without MTP speculative decoding (on by default when the file "
                        "carries its MTP block)")
    g.add_argument("--mtp-tokens", type=_positive, metavar="N",
                   help="GGUF: MTP draft tokens per step (default 1); asks for MTP, so the file must carry the block")
    return p


def split_args(argv: Sequence[str]) -> tuple[Options, list[str]]:
    """fastcomm-serve's options, and everything else in its original order (for vLLM, untouched)."""
    ns, rest = parser().parse_known_args(list(argv))
    if ns.mtp is False and ns.mtp_tokens is not None:
        raise ServeError("--no-mtp and --mtp-tokens contradict each other: pick one")
    return Options(dry_run=ns.dry_run, gpus=ns.gpus, transport=ns.transport, fastcomm=ns.fastcomm, fusion=ns.fusion,
                   nccl_env=ns.nccl_env, help=ns.help, version=ns.version, capability=ns.capability,
                   mtp=True if ns.mtp_tokens is not None else ns.mtp, mtp_tokens=ns.mtp_tokens), rest


def _option_value(args: Sequence[str], names: Sequence[str]) -> str | None:
    """The last value given to any of ``names`` (vLLM also accepts underscores: --tensor_parallel_size)."""
    found = None
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if name.startswith("--"):
            name = name.replace("_", "-")
        if name in names:
            if eq:
                found = inline
            elif i + 1 < len(args):
                found = args[i + 1]
    return found


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a.partition("=")[0].replace("_", "-") == flag for a in args)


# vLLM's spellings of a speculative-decoding choice (0.25 and newer): the JSON option, its short form, its
# dotted keys (--speculative-config.method=mtp) and the --spec-* shorthands.
SPECULATION_FLAGS = ("--speculative-config", "-sc", "--spec-method", "--spec-model", "--spec-tokens")


def _speculation_flag(args: Sequence[str]) -> str | None:
    """The first option in ``args`` that chooses speculative decoding, as the user spelled it, else None."""
    for a in args:
        name = a.partition("=")[0]
        name = name.replace("_", "-") if name.startswith("--") else name
        if name in SPECULATION_FLAGS or name.startswith("--speculative-config."):
            return name
    return None


def _model(args: Sequence[str]) -> str:
    if args and not args[0].startswith("-"):
        return args[0]
    model = _option_value(args, ("--model",))
    if model is None:
        raise ServeError("no model given: fastcomm-serve MODEL [options] (a local directory or a Hugging Face id)")
    return model


def _replace_model(args: list[str], old: str, new: str) -> list[str]:
    """``args`` with the model argument (positional first, or --model's value) set to ``new``."""
    out = list(args)
    if out and out[0] == old and not old.startswith("-"):
        out[0] = new
        return out
    for i, arg in enumerate(out):
        name, eq, inline = arg.partition("=")
        if name == "--model":
            if eq and inline == old:
                out[i] = f"--model={new}"
            elif not eq and i + 1 < len(out) and out[i + 1] == old:
                out[i + 1] = new
    return out


def _int_option(args, names, what) -> int | None:
    value = _option_value(args, names)
    if value is None:
        return None
    if not re.fullmatch(r"\d+", value) or int(value) < 1:
        raise ServeError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


# ---- the machine ----------------------------------------------------------------------------------------

def probe_topology():
    """fastcomm's topology probe, or None when it is unavailable (it never needs to be)."""
    try:
        from fastcomm import topology

        topo = topology.probe()
        return topo if topo.gpus else None
    except Exception:
        return None


def count_gpus(topo) -> int:
    """Visible GPUs: the probe's (NVML, else nvidia-smi, CUDA_VISIBLE_DEVICES applied), else torch's."""
    if topo is not None:
        return len(topo.gpus)
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def detect_capability(topo) -> tuple[int, int] | None:
    """The GPUs' compute capability (the probe's, else torch's), or None; GPUs of mixed capability give the
    lowest, which is what every rank must run."""
    if topo is not None:
        found = [g.compute_capability for g in topo.gpus if g.compute_capability is not None]
        if found:
            return min(found)
    try:
        import torch

        return tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None
    except Exception:
        return None


def nccl_env(topo, tp: int) -> list[tuple[str, str, str]]:
    """NCCL settings for the all-reduces that stay on NCCL, from the topology of the first ``tp`` GPUs."""
    if topo is None or len(topo.gpus) < tp or tp < 2:
        return []
    from fastcomm import policy
    from fastcomm.topology import restrict

    sub = restrict(topo, list(range(tp)))
    return policy.nccl_env(*policy.summarize(sub.link, sub.p2p))


# ---- building the command -------------------------------------------------------------------------------

def build(opts: Options, vllm_args: Sequence[str], environ: Mapping[str, str], *, topo=None,
          gpus: int | None = None) -> Launch:
    """The command and environment to run; raises ServeError for anything that would fail later."""
    if not vllm_installed():
        raise ServeError(f"vLLM is not installed in this Python environment ({sys.executable}); install it "
                         f"with: {VLLM_HINT}")
    model = _model(vllm_args)
    args = list(vllm_args)
    notes = []
    env: list[tuple[str, str, str]] = []
    plugins_needed = ["fastcomm"] if opts.fastcomm else []
    gguf_model = _is_gguf(model)
    if not gguf_model:
        if opts.mtp is not None:
            raise ServeError("--no-mtp / --mtp-tokens choose MTP for a GGUF model; for a checkpoint pass vLLM's "
                             "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": N}'")
        if looks_like_path(model) and not os.path.exists(os.path.expanduser(model)):
            raise ServeError(f"model path {model!r} does not exist")
        folder = os.path.expanduser(model)
        if os.path.isdir(folder) and not any(os.path.isfile(os.path.join(folder, name)) for name in CHECKPOINT_FILES):
            raise ServeError(f"model folder {model!r} holds no {' / '.join(CHECKPOINT_FILES)} (a checkpoint) "
                             "and no .gguf file")
    if gpus is None:
        gpus = count_gpus(topo)
    if gpus < 1:
        raise ServeError("no GPU found (fastcomm-serve needs CUDA GPUs; --gpus N overrides detection)")

    tp = _int_option(args, ("--tensor-parallel-size", "-tp"), "--tensor-parallel-size")
    pp = _int_option(args, ("--pipeline-parallel-size", "-pp"), "--pipeline-parallel-size") or 1
    if tp is None:
        tp = gpus
        args += ["--tensor-parallel-size", str(tp)]
        notes.append(f"tensor parallel {tp} (all visible GPUs)")
    if tp > gpus:
        raise ServeError(f"--tensor-parallel-size {tp} is larger than the {gpus} visible GPU(s)")
    if tp * pp > gpus:
        raise ServeError(f"tensor parallel {tp} x pipeline parallel {pp} needs {tp * pp} GPUs; {gpus} visible")
    if gguf_model:  # after the TP size is known: the file must split at it
        capability = opts.capability or detect_capability(topo)
        args, gguf_notes = _gguf_args(opts, model, args, tp, capability)
        notes += gguf_notes
        plugins_needed += ["gguf", GGUF_ENTRY_POINT]
    if tp == 1:
        notes.append("tensor parallel 1: there is no all-reduce for fastcomm to speed up")
    if _has_flag(args, "--enforce-eager"):
        notes.append("warning: --enforce-eager turns CUDA graphs off; fastcomm still runs, but decode "
                     "keeps vLLM's per-layer launch overhead")

    def put(name: str, value: str, why: str) -> None:
        if name in environ:  # the user's environment wins
            notes.append(f"keeping {name}={environ[name]} from the environment (fastcomm-serve would set {value})")
        else:
            env.append((name, value, why))

    put("FASTCOMM_VLLM", "1" if opts.fastcomm else "0",
        "fastcomm's vLLM plugin on" if opts.fastcomm else "baseline: vLLM's own all-reduce")
    if opts.transport is not None:
        put("FASTCOMM_TRANSPORT", opts.transport, "--fastcomm-transport")
    if opts.fusion:
        if not opts.fastcomm:
            raise ServeError("--fastcomm-fusion needs fastcomm: drop --no-fastcomm")
        put("FASTCOMM_VLLM_FUSION", "1", "--fastcomm-fusion")
    plugins = environ.get("VLLM_PLUGINS")
    if plugins is not None:
        listed = [p.strip() for p in plugins.split(",") if p.strip()]
        missing = [p for p in plugins_needed if p not in listed]
        if missing:
            env.append(("VLLM_PLUGINS", ",".join(listed + missing),
                        f"VLLM_PLUGINS restricts plugins; {', '.join(missing)} must load"))
    if opts.fastcomm and not _plugin_installed():
        raise ServeError("fastcomm's vLLM plugin is not installed in this environment "
                         f"({VLLM_HINT} registers the vllm.general_plugins entry point)")
    if opts.nccl_env:
        for name, value, why in nccl_env(topo, tp):
            put(name, value, why)
    argv = (sys.executable, "-m", VLLM_MAIN, "serve", *args)
    return Launch(argv=argv, env=tuple(env), notes=tuple(notes), gpus=gpus)


def vllm_installed() -> bool:
    # find_spec alone is fooled by a namespace package (e.g. a tests/vllm folder on sys.path).
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def _is_gguf(model: str) -> bool:
    from . import gguf

    return model.endswith(".gguf") or gguf.is_gguf(model)


GGUF_ENTRY_POINT = "fastcomm_gguf"


def _gguf_args(opts: Options, model: str, args: list[str], tp: int,
               capability: tuple[int, int] | None = None) -> tuple[list[str], list[str]]:
    """The vLLM arguments for a GGUF model, and what was decided (with why)."""
    from . import gguf
    from .gguf import attention, kernels

    user_spec = _speculation_flag(args)
    if user_spec is not None and opts.mtp is not None:
        raise ServeError(f"{user_spec} and --no-mtp / --mtp-tokens both choose speculative decoding: pick one")
    try:
        # With --skip-tokenizer-init vLLM loads no tokenizer, so none is derived (or missed).
        plan = gguf.plan(model, mtp=False if user_spec is not None else opts.mtp,
                         num_speculative_tokens=opts.mtp_tokens or 1,
                         tokenizer=_option_value(args, ("--tokenizer",)),
                         hf_config_path=_option_value(args, ("--hf-config-path",)),
                         derive_tokenizer=not _has_flag(args, "--skip-tokenizer-init"),
                         tensor_parallel_size=tp)
    except gguf.GgufError as e:
        raise ServeError(str(e)) from None
    notes = list(plan.notes)
    if user_spec is not None:
        notes = [n for n in notes if not n.startswith("MTP")] + [f"speculative decoding as your {user_spec} says"]
    args = _replace_model(args, model, plan.kwargs["model"])
    if plan.glm:
        if not _has_flag(args, "--served-model-name"):
            # vLLM would name the model by its path, which every client request must then repeat; the
            # file's own name comes first (what /v1/models and responses show), the path stays accepted.
            name = gguf.files.model_name(plan.files)
            args += ["--served-model-name", name, plan.kwargs["model"]]
            notes.append(f"served as {name!r} (the path is accepted too; --served-model-name overrides)")
        if not _has_flag(args, "--hf-config-path"):
            args += ["--hf-config-path", plan.kwargs["hf_config_path"]]
        if not _has_flag(args, "--tokenizer") and "tokenizer" in plan.kwargs:
            args += ["--tokenizer", plan.kwargs["tokenizer"]]
        if plan.mtp and user_spec is None:
            args += ["--speculative-config", json.dumps(plan.kwargs["speculative_config"], separators=(",", ":"))]
        chosen = attention.choose(capability, plan.index_topk, _user_attention(args),
                                  attention.stack() if capability and capability[0] == 12 else _NO_STACK)
        if chosen.error:
            raise ServeError(chosen.error)
        args += chosen.args
        notes += chosen.notes
        if not _gguf_adapter_installed():
            raise ServeError(f"fastcomm's GGUF adapter entry point ({GGUF_ENTRY_POINT}) is not installed; "
                             f"reinstall fastcomm: {gguf.errors.INSTALL_HINT}")
    kernel = kernels.status()
    notes.append(f"warning: {kernel.warning()}" if not kernel.cuda else
                 f"K-quant kernels: vllm-gguf-plugin's CUDA extension ({kernel.detail})")
    notes.append(_decode_kernels_note())
    return args, notes


_NO_STACK = None  # the installed packages are read only where the choice depends on them (sm_120)


def _user_attention(args: Sequence[str]):
    from .gguf.attention import UserAttention

    block = _option_value(args, ("--block-size",))
    if block is not None and not re.fullmatch(r"\d+", block):
        raise ServeError(f"--block-size must be a positive integer, got {block!r}")
    return UserAttention(dtype=_option_value(args, ("--dtype",)),
                         kv_cache_dtype=_option_value(args, ("--kv-cache-dtype",)),
                         block_size=int(block) if block is not None else None,
                         backend=_option_value(args, ("--attention-backend",)))


def _decode_kernels_note() -> str:
    """Which kernels the workers' GGUF products take (fastcomm_vllm.gguf.plugin reads the same setting)."""
    from fastcomm import kquant
    from fastcomm.kquant import forms as measured
    from fastcomm.kquant.settings import Settings

    try:
        settings = Settings.from_env()
    except ConfigError as e:
        raise ServeError(str(e)) from None
    setting = settings.kernels
    if setting == "plugin":
        return "GGUF products: vllm-gguf-plugin's kernels at every token count (FASTCOMM_GGUF_KERNELS=plugin)"
    types = "/".join(kquant.NAMES[t] for t in sorted(kquant.NAMES))
    forms = " (dp4a forms only: FASTCOMM_GGUF_KERNELS=dp4a)" if setting == "dp4a" else ""
    return (f"GGUF products of 1-{kquant.MAX_TOKENS} tokens (decode, MTP verify) of {types} weights: fastcomm's "
            f"K-quant kernels{forms}, their forms by {measured.describe(settings.forms)}; prefill and "
            "other types: the plugin's (FASTCOMM_GGUF_KERNELS=plugin: all the plugin's)")


def _entry_points() -> list[str]:
    return [ep.name for ep in importlib.metadata.entry_points(group="vllm.general_plugins")]


def _plugin_installed() -> bool:
    return "fastcomm" in _entry_points()


def _gguf_adapter_installed() -> bool:
    return GGUF_ENTRY_POINT in _entry_points()


def describe_topology(topo, gpus: int) -> str:
    if topo is None:
        return f"{gpus} GPU(s) (topology not probed)"
    from fastcomm import policy

    worst, all_p2p = policy.summarize(topo.link, topo.p2p)
    p2p = {True: "P2P between all pairs", False: "no P2P between some pairs", None: "P2P unknown"}[all_p2p]
    names = sorted({g.name for g in topo.gpus if g.name})
    return f"{gpus} GPU(s) {'/'.join(names)}: slowest link {worst.value}, {p2p} (via {topo.source})"


def versions() -> str:
    """fastcomm's version and those of the packages fastcomm-serve runs (or 'not installed')."""
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return "  ".join(f"{d} {version(d)}" for d in ("fastcomm", "vllm", "torch", "vllm-gguf-plugin", "gguf"))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts, vllm_args = split_args(argv)
        if opts.help:
            print(parser().format_help())
            return 0
        if opts.version:
            print(versions())
            return 0
        topo = None if opts.gpus is not None else probe_topology()
        launch = build(opts, vllm_args, os.environ, topo=topo, gpus=opts.gpus)
    except (ServeError, ConfigError) as e:  # a user's input: one line, no traceback
        print(f"fastcomm-serve: error: {e}", file=sys.stderr)
        return 2
    print(f"fastcomm-serve: {describe_topology(topo, launch.gpus)}", file=sys.stderr)
    for note in launch.notes:
        print(f"fastcomm-serve: {note}", file=sys.stderr)
    if opts.dry_run:
        for name, value, why in launch.env:
            print(f"# {name}={value}: {why}")
        print(launch.shell())
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(launch.argv[0], list(launch.argv), launch.environment(os.environ))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
