"""End-to-end decode benchmark: vLLM serving a model, one all-reduce backend per process.

    fastcomm bench-decode --configs vllm,nccl,fastcomm --max-tokens 128     # shipped GLM-5-shaped config
    fastcomm bench-decode --model model-00001-of-00003.gguf --mtp 1         # a GGUF file, with MTP
    fastcomm bench-decode --compare run1.json run2.json      # merge runs made in separate calls (a backend
                                                             # in several files: one row of medians)

The default model is a GLM-5-shaped config shipped with fastcomm, run with vLLM's dummy weights (random,
the same seed in every backend). Prompts are random token ids (the tokenizer is skipped). Each backend runs
in its own subprocess (start-up of a 78-layer model takes minutes). Results go to --out, by default a file
in the current directory, with the vLLM logs in a folder beside it. Modules: decode_models (what --model
names), decode_runner / decode_worker (a process per backend), decode_merge (rounds, --compare),
decode_report (the table).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from fastcomm.config import microseconds
from fastcomm.measure import source_commit

from . import decode_models
from .decode_backends import BACKENDS, ROW_DEFINING
from .decode_merge import PROMPTS, combine_rounds, merge_files
from .decode_report import compare_tokens, print_report
from .decode_runner import run_backend, why_not_runnable

PROG = "fastcomm bench-decode"


EPILOG = """\
--model is, tried in this order:
  a GGUF file (or the first part of a split one)   its own weights
  a directory with config.json and weight files    a local checkpoint: real weights unless --dummy
  a directory with only config.json                vLLM's dummy weights
  a shipped config name ({shipped})  vLLM's dummy weights
  a Hugging Face id (org/name)                     downloaded by vLLM: real weights unless --dummy
Dummy weights are random, from the same seed in every backend, so every row computes the same thing; the
report's header says which weights a run used. Prompts are random token ids in every case.
MTP: off unless --mtp N (a GGUF file may carry its own default; --no-mtp turns it off there too).
"""


class UsageError(Exception):
    """A mistake in the arguments or the environment: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own: usage plus message, on two lines; ours is one
        raise UsageError(message)


def _int_list(flag: str, text: str, *, minimum: int = 1) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < minimum for v in values):
        raise UsageError(f"{flag} {text!r}: expected a comma list of integers >= {minimum}, such as 1,4,16")
    return values


def settings_set(env=None) -> dict | None:
    """The FASTCOMM_* settings set where bench-decode runs (every row's engine inherits them, e.g.
    FASTCOMM_GGUF_DEQUANT_MIN_TOKENS), so a record says what it measured; None when none is set."""
    from fastcomm.config import is_path
    from fastcomm.variables import check_environment

    found = {}
    for s in check_environment(env):
        if s.raw is None or s.var.name == "FASTCOMM_CACHE_DIR":  # where kernels are cached measures nothing
            continue
        # a path (the tuning file) by its name: records hold no machine's paths
        found[s.var.name] = Path(s.raw).name if is_path(s.var) else s.raw
    return found or None


def parse_fastcomm_env(items: list[str]) -> dict:
    """KEY=VALUE pairs for the fastcomm rows (e.g. FASTCOMM_ALGO=one_shot): an A/B of one knob in the same
    call. Only FASTCOMM_* variables, and none of those that define a row."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("FASTCOMM_"):
            raise UsageError(f"--fastcomm-env {item!r}: expected FASTCOMM_NAME=VALUE")
        if key in ROW_DEFINING:
            raise UsageError(f"--fastcomm-env {key} defines the rows; pick another config instead")
        env[key] = value
    return env


def backend_timeout(timeout: float, deadline: float | None, now: float) -> float:
    """Seconds a backend may run: ``timeout``, or less where ``deadline`` (epoch seconds) comes sooner; at least 1,
    so a backend past the deadline is started and cut at once and its row says it timed out."""
    return timeout if deadline is None else max(1.0, min(timeout, deadline - now))


def check_numbers(args) -> None:
    """The counts and fractions every backend would be started with, checked once before any starts (a bad one
    would otherwise fail each backend after its start-up, its reason only in that backend's log)."""
    for flag, value in (("--tp", args.tp), ("--prompt-len", args.prompt_len), ("--repeats", args.repeats),
                        ("--profile-tokens", args.profile_tokens)):
        if value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization {args.gpu_memory_utilization}: a fraction in (0, 1]")
    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout}: seconds, more than 0")
    if args.max_model_len < args.prompt_len + args.max_tokens:
        raise UsageError(f"--max-model-len {args.max_model_len} cannot hold a prompt of {args.prompt_len} and "
                         f"{args.max_tokens} output tokens")
    from fastcomm.commands.args import visible_gpus

    gpus, _ = visible_gpus()
    if gpus and args.tp > gpus:  # none at all: vLLM's own start-up says why
        raise UsageError(f"--tp {args.tp}: only {gpus} GPU(s) visible")


def check_settings(fastcomm_env: dict) -> None:
    """fastcomm's settings as the fastcomm rows will see them (this environment plus --fastcomm-env)."""
    from fastcomm.config import Config, ConfigError

    try:
        Config.from_env({**os.environ, **fastcomm_env})
    except ConfigError as e:
        raise UsageError(str(e)) from None


def parse_args(argv):
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=EPILOG.format(shipped=", ".join(decode_models.shipped())))
    p.add_argument("--model", default="glm5-78L-16E",
                   help="a GGUF file, a checkpoint or config directory, a shipped config "
                        f"({', '.join(decode_models.shipped())}; vLLM dummy weights) or a Hugging Face id "
                        "(default %(default)s)")
    p.add_argument("--dummy", action="store_true",
                   help="vLLM's dummy (random) weights for a checkpoint or Hugging Face id: no weights loaded; "
                        "config-only models always run with them")
    p.add_argument("--spread-routing", action="store_true",
                   help="dummy weights only: re-draw each MoE router as the GGUF benchmark file draws it, so tokens "
                        "spread over the experts as they do there (vLLM's dummy router sends every token to the "
                        "same experts)")
    p.add_argument("--sweep-temperature", type=float, default=0.0, metavar="T",
                   help="the concurrency sweep's requests sample at temperature T, each from its own seed (the same "
                        "tokens in every repeat), instead of greedily: greedy decoding of random weights falls into "
                        "the same 2-4 tokens in every request, so a step's tokens route alike and read the experts "
                        "of one; each point records how many distinct tokens its requests had a step (default 0: "
                        "greedy)")
    p.add_argument("--quantization", default=None, metavar="METHOD",
                   help="vLLM's --quantization for a checkpoint, config or Hugging Face model, e.g. fp8 (dummy "
                        "weights are quantized as they load); a GGUF file brings its own")
    mtp = p.add_mutually_exclusive_group()
    mtp.add_argument("--mtp", type=int, default=None, metavar="N",
                     help="speculative decoding with the model's MTP layers, N draft tokens per step; the report "
                          "gives tokens per step beside tok/s")
    mtp.add_argument("--no-mtp", dest="mtp", action="store_const", const=0, help="no MTP, whatever the model's default")
    p.add_argument("--configs", default=",".join(BACKENDS), help=f"comma list of {', '.join(BACKENDS)}")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (>= 64 for the token check)")
    p.add_argument("--capture-sizes", default="default",
                   help="cudagraph_capture_sizes: 'default' (vLLM's) or a list such as 1,2,4,8")
    p.add_argument("--concurrency", default="1,4,16,64", help="concurrent requests for the sweep")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="vLLM's max_num_seqs (default: the largest concurrency). vLLM's default capture sizes "
                        "grow with it: 256 gives its 51-size list, 64 gives sizes up to 128")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="vLLM's max_num_batched_tokens (default: vLLM's). vLLM's start-up profiles memory with a "
                        "dummy prefill of this many tokens (16384 by default: a minute of a 78-layer GGUF's "
                        "start-up); it must hold the largest concurrency's prompts, so they prefill in one step")
    p.add_argument("--tp", type=int, default=2, help="tensor parallel size")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    p.add_argument("--seed", type=int, default=0, help="prompt token ids")
    p.add_argument("--profile-dir", default=None,
                   help="also profile decode steps per backend with vLLM's torch profiler (traces per backend)")
    p.add_argument("--profile-tokens", type=int, default=16, help="tokens generated while profiling")
    p.add_argument("--profile-concurrency", default="1", metavar="N,...",
                   help="requests decoded together while profiling, one profile each (e.g. 8: the all-reduce share "
                        "at 8 concurrent; 1,2,4: a verify step of 0, 1 and 3 drafts). 1's traces go to the "
                        "backend's folder, N's to BACKEND-cN beside it")
    p.add_argument("--standin-us", default=None, metavar="US,...",
                   help="TP 1 only: a stand-in kernel where TP > 1 would all-reduce, timed at each of these "
                        "microseconds in one engine (fastcomm_vllm.standin; e.g. 0,5,10,20,60 for a TP 8 shard)")
    p.add_argument("--fastcomm-env", action="append", default=[], metavar="FASTCOMM_NAME=VALUE",
                   help="set a fastcomm variable in the fastcomm rows (repeatable), e.g. FASTCOMM_ALGO=one_shot; "
                        "recorded in the results, and --compare never merges it with runs without it")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the configs round-robin this many times; rows are medians (takes run order out)")
    p.add_argument("--timeout", type=float, default=1500, help="seconds per backend (start-up included)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds since the epoch no backend runs past (a device call's end: the time its caller "
                        "spent before bench-decode started is then not the caller's to guess)")
    p.add_argument("--out", default=None,
                   help="JSON results (default: ./decode-<model>-<time>.json); the vLLM logs go in a folder beside it")
    p.add_argument("--compare", nargs="+", default=None, metavar="JSON", help="print merged earlier results and exit")
    return p.parse_args(argv)


def load_results(paths: list[str]) -> list[dict]:
    files = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            raise UsageError(f"--compare {path}: {e.strerror or e}") from None
        except ValueError as e:
            raise UsageError(f"--compare {path}: not JSON ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("meta"), dict) or not isinstance(data.get("results"), dict):
            raise UsageError(f"--compare {path}: not a bench-decode results file (no meta and results)")
        files.append(data)
    return files


def writable_out(path: Path) -> Path:
    """``path``, once its folder exists and takes a file (checked before minutes of start-up, not after)."""
    if path.is_dir():
        raise UsageError(f"--out {path}: is a directory; name a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".bench-decode-"):
            pass
    except OSError as e:
        raise UsageError(f"--out {path}: cannot write there ({e.strerror or e})") from None
    return path


def main(argv=None) -> int:
    try:
        return _main(argv)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


def _main(argv) -> int:
    args = parse_args(argv)
    if args.compare:
        results, meta = merge_files(load_results(args.compare))
        print_report(results, meta)
        return 0

    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in BACKENDS]
    if unknown or not names:
        raise UsageError(f"--configs: unknown config(s) {unknown}; choose from {', '.join(BACKENDS)}")
    if args.rounds < 1:
        raise UsageError("--rounds must be at least 1")
    if args.max_tokens < 2:
        raise UsageError("--max-tokens must be at least 2 (TPOT needs two lengths)")
    conc = _int_list("--concurrency", args.concurrency)
    sizes = None if args.capture_sizes == "default" else _int_list("--capture-sizes", args.capture_sizes)
    if args.max_num_seqs is not None and args.max_num_seqs < max(conc):
        raise UsageError(f"--max-num-seqs {args.max_num_seqs} is below the largest concurrency {max(conc)}: vLLM "
                         f"would queue requests and the sweep would not measure that concurrency")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < max(conc) * args.prompt_len:
        raise UsageError(f"--max-num-batched-tokens {args.max_num_batched_tokens} is below the largest concurrency's "
                         f"prompts ({max(conc)} x {args.prompt_len} tokens): they would prefill over several steps")
    if not 0 <= args.sweep_temperature < float("inf"):
        raise UsageError(f"--sweep-temperature {args.sweep_temperature}: a temperature is a finite number >= 0")
    prof_conc = _int_list("--profile-concurrency", args.profile_concurrency)
    if max(prof_conc) > max(conc) or len(set(prof_conc)) != len(prof_conc):
        raise UsageError(f"--profile-concurrency {args.profile_concurrency}: each must be between 1 and the largest "
                         f"concurrency {max(conc)} (the prompts and max_num_seqs are sized by it), each once")
    check_numbers(args)
    standin = None
    if args.standin_us is not None:
        try:  # each time as FASTCOMM_TEST_STANDIN_US takes it, which the rows are started with
            standin = [microseconds(x) for x in args.standin_us.split(",")]
        except ValueError as e:
            raise UsageError(f"--standin-us {args.standin_us!r}: {e} (e.g. 0,5,10,20,60)") from None
        if args.tp != 1:
            raise UsageError(f"--standin-us stands in for all-reduces at TP 1; at --tp {args.tp} the real ones run")
    fastcomm_env = parse_fastcomm_env(args.fastcomm_env)
    check_settings(fastcomm_env)
    try:
        model = decode_models.resolve(args.model, dummy=args.dummy, mtp=args.mtp)
    except decode_models.ModelError as e:
        raise UsageError(str(e)) from None
    if args.spread_routing and model.weights != "dummy":
        raise UsageError("--spread-routing re-draws routers of dummy weights; this model has real ones")
    if args.quantization:
        if model.source == "gguf":
            raise UsageError(f"--quantization {args.quantization}: a GGUF file brings its own quantization")
        model = dataclasses.replace(model, engine={**model.engine, "quantization": args.quantization})
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = writable_out(Path(args.out) if args.out else Path.cwd() / f"decode-{model.label}-{stamp}.json")
    problem = why_not_runnable(any(BACKENDS[n].fastcomm for n in names))
    if problem:
        raise UsageError(problem)
    if args.max_tokens < 64:
        print(f"bench-decode: note: the token agreement check covers only {args.max_tokens} tokens (< 64)")

    spec = dict(engine=model.engine, gguf=model.gguf, tp=args.tp, max_tokens=args.max_tokens, capture_sizes=sizes,
                concurrency=conc, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                prompt_len=args.prompt_len, prompts=PROMPTS,
                repeats=args.repeats, max_model_len=args.max_model_len, seed=args.seed, mtp=model.mtp,
                gpu_memory_utilization=args.gpu_memory_utilization, profile_dir=args.profile_dir,
                profile_tokens=args.profile_tokens, profile_concurrency=prof_conc,
                fastcomm_env=fastcomm_env or None, quantization=model.engine.get("quantization"),
                spread_routing=args.spread_routing, sweep_temperature=args.sweep_temperature, standin_us=standin)
    # The record names the model as given (no absolute path of this machine) and the commit it ran.
    meta = {**{k: v for k, v in spec.items() if k not in ("engine", "gguf")}, "model": model.record_name, "model_source": model.source,
            "weights": model.weights, "configs": names, "rounds": args.rounds, "started": stamp,
            "fastcomm_commit": source_commit(os.environ.get("FASTCOMM_COMMIT")), "settings": settings_set()}
    log_dir = Path(tempfile.mkdtemp(prefix=f"{out.stem}-logs-", dir=out.parent))
    print(f"bench-decode: model {model.describe()}", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    results = {}
    for k in range(args.rounds):
        for name in names:
            print(f"bench-decode: {name}: {BACKENDS[name].about}"
                  + (f" (round {k + 1}/{args.rounds})" if args.rounds > 1 else "") + " ...", flush=True)
            runs[name].append(run_backend(BACKENDS[name], spec, log_dir,
                                          backend_timeout(args.timeout, args.deadline, time.time()),
                                          f"-r{k + 1}" if args.rounds > 1 else ""))
            results[name] = combine_rounds(runs[name])
            out.write_text(json.dumps({"meta": meta, "results": results, "tokens": compare_tokens(results)}, indent=1))
    print_report(results, meta)
    print(f"# results: {os.path.relpath(out)}  (logs: {os.path.relpath(log_dir)})")
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
