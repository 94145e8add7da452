"""`fastcomm-serve`: `vllm serve` with fastcomm active.

    fastcomm-serve MODEL [fastcomm-serve options] [any `vllm serve` option ...]

Detects the GPUs and their topology, defaults --tensor-parallel-size to the GPU count, leaves CUDA graphs
on, sets the environment below, and execs `python -m vllm.entrypoints.cli.main serve` with every other
argument exactly as given. Variables already set in your environment are never overridden.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from typing import Mapping, Sequence

HELP = """\
usage: fastcomm-serve MODEL [fastcomm-serve options] [vllm serve options ...]

Runs `vllm serve` with fastcomm's all-reduce (the fastcomm vLLM plugin) active. Every argument that is
not one of the options below goes to `vllm serve` unchanged (see `vllm serve --help`).

fastcomm-serve options:
  -h, --help            show this help and exit
  --dry-run             print the exact command and environment, do not start vLLM
  --gpus N              assume N visible GPUs instead of detecting them (e.g. for --dry-run elsewhere)
  --fastcomm-transport {auto,p2p,host}
                        FASTCOMM_TRANSPORT: peer GPU memory (p2p), pinned host memory (host, for GPUs
                        without P2P), or the probe's choice (auto)
  --fastcomm-fusion     FASTCOMM_VLLM_FUSION=1: also fuse all-reduce + RMSNorm into one fastcomm kernel.
                        Off by default until an end-to-end run shows it faster than the all-reduce alone
  --no-fastcomm         run the same command with FASTCOMM_VLLM=0 (vLLM's own all-reduce; a baseline)
  --no-nccl-env         do not set the NCCL variables described below

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
"""

VLLM_MAIN = "vllm.entrypoints.cli.main"
TRANSPORTS = ("auto", "p2p", "host")


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

def split_args(argv: Sequence[str]) -> tuple[Options, list[str]]:
    """fastcomm-serve's options, and everything else in its original order (for vLLM, untouched)."""
    opts, rest, i = {}, [], 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        if arg in ("-h", "--help"):
            opts["help"] = True
        elif arg == "--dry-run":
            opts["dry_run"] = True
        elif arg == "--no-fastcomm":
            opts["fastcomm"] = False
        elif arg == "--fastcomm-fusion":
            opts["fusion"] = True
        elif arg == "--no-nccl-env":
            opts["nccl_env"] = False
        elif name in ("--gpus", "--fastcomm-transport"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ServeError(f"{name} needs a value")
                i += 1
                inline = argv[i]
            if name == "--gpus":
                if not inline.isdigit():
                    raise ServeError(f"--gpus expects a number, got {inline!r}")
                opts["gpus"] = int(inline)
            else:
                if inline not in TRANSPORTS:
                    raise ServeError(f"--fastcomm-transport must be one of {', '.join(TRANSPORTS)}, got {inline!r}")
                opts["transport"] = inline
        else:
            rest.append(arg)
        i += 1
    return Options(**opts), rest


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


def _model(args: Sequence[str]) -> str:
    if args and not args[0].startswith("-"):
        return args[0]
    model = _option_value(args, ("--model",))
    if model is None:
        raise ServeError("no model given: fastcomm-serve MODEL [options] (a local directory or a Hugging Face id)")
    return model


def _looks_like_path(model: str) -> bool:
    # A Hugging Face id is "name" or "org/name"; anything else that names a file system location is a path.
    return model.startswith(("/", "./", "../", "~")) or model in (".", "..") or model.count("/") > 1


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
    """Visible GPUs: the probe, else torch, else `nvidia-smi -L` (filtered by CUDA_VISIBLE_DEVICES)."""
    if topo is not None:
        return len(topo.gpus)
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except Exception:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        n = min(n, len([v for v in visible.split(",") if v.strip()]))
    return n


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
    if importlib.util.find_spec("vllm") is None:
        raise ServeError("vLLM is not installed in this Python environment "
                         f"({sys.executable}); install it with: pip install 'fastcomm[vllm]'")
    model = _model(vllm_args)
    if _looks_like_path(model) and not os.path.exists(os.path.expanduser(model)):
        raise ServeError(f"model path {model!r} does not exist")
    if gpus is None:
        gpus = count_gpus(topo)
    if gpus < 1:
        raise ServeError("no GPU found (fastcomm-serve needs CUDA GPUs; --gpus N overrides detection)")

    args = list(vllm_args)
    notes = []
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
    if tp == 1:
        notes.append("tensor parallel 1: there is no all-reduce for fastcomm to speed up")
    if _has_flag(args, "--enforce-eager"):
        notes.append("warning: --enforce-eager turns CUDA graphs off; fastcomm still runs, but decode "
                     "keeps vLLM's per-layer launch overhead")

    env: list[tuple[str, str, str]] = []

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
    if opts.fastcomm and plugins is not None and "fastcomm" not in [p.strip() for p in plugins.split(",")]:
        env.append(("VLLM_PLUGINS", ",".join(p for p in (plugins, "fastcomm") if p),
                    "VLLM_PLUGINS restricts plugins; fastcomm's must load"))
    if opts.fastcomm and not _plugin_installed():
        raise ServeError("fastcomm's vLLM plugin is not installed in this environment "
                         "(pip install 'fastcomm[vllm]' registers the vllm.general_plugins entry point)")
    if opts.nccl_env:
        for name, value, why in nccl_env(topo, tp):
            put(name, value, why)
    argv = (sys.executable, "-m", VLLM_MAIN, "serve", *args)
    return Launch(argv=argv, env=tuple(env), notes=tuple(notes), gpus=gpus)


def _plugin_installed() -> bool:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    return any(ep.name == "fastcomm" for ep in eps)


def describe_topology(topo, gpus: int) -> str:
    if topo is None:
        return f"{gpus} GPU(s) (topology not probed)"
    from fastcomm import policy

    worst, all_p2p = policy.summarize(topo.link, topo.p2p)
    p2p = {True: "P2P between all pairs", False: "no P2P between some pairs", None: "P2P unknown"}[all_p2p]
    names = sorted({g.name for g in topo.gpus if g.name})
    return f"{gpus} GPU(s) {'/'.join(names)}: slowest link {worst.value}, {p2p} (via {topo.source})"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts, vllm_args = split_args(argv)
        if opts.help:
            print(HELP)
            return 0
        topo = None if opts.gpus is not None else probe_topology()
        launch = build(opts, vllm_args, os.environ, topo=topo, gpus=opts.gpus)
    except ServeError as e:
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
