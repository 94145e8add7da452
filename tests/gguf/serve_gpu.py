"""`fastcomm-serve` end to end on one GPU: the tiny GLM-5 GGUF (3 split files, MTP block) served over HTTP.

    python tests/gguf/serve_gpu.py OUTDIR [--compare-no-mtp] [--budget S] [--health-timeout S] [--tp N]
                                          [--serve-args 'MORE OPTIONS']

1. `fastcomm-serve FIRST_SHARD --dry-run <settings>`: it must choose MTP (its "MTP on" note and a
   --speculative-config with method mtp); the command it built is recorded.
2. The same command for real, in its own process group, output to OUTDIR/serve.log; /health polled until it
   answers 200, bounded by --health-timeout and the budget; if the server exits first, stop at once.
3. Two greedy /v1/completions (token-id prompts, 16 tokens each, ignore_eos): each must return 16 token ids;
   /metrics: vLLM's spec-decode draft counter must be > 0 (the MTP draft ran); the log must hold
   fastcomm-serve's "K-quant kernels: vllm-gguf-plugin's CUDA extension" note and never the Triton-fallback
   warning (fastcomm_vllm.gguf.kernels, printed by fastcomm-serve and by the plugin in each vLLM process).
4. The server's process group is always terminated (finally, and on SIGTERM from an outer `timeout`), and
   OUTDIR/serve_gpu.json holds everything observed, machine paths written as <tmp>, <repo>, <python>. Exit
   status 0 only if every check passed.
5. --compare-no-mtp: a second start with --no-mtp; the same two requests must give the same greedy tokens.
   Skipped (and said so in the JSON) when what is left of --budget cannot hold a second start.

Tokenizer: the tiny GGUF carries a byte-level BPE vocabulary (tokenizer.ggml.*: tokens, merges, types),
from which fastcomm-serve derives tokenizer.json (transformers' GGUF converter where the installed release has
one for it, else fastcomm's build with `tokenizers`: fastcomm_vllm.gguf.derive). Prompts are token ids either way, so the tokens compared never depend on a tokenizer. Where it
cannot derive one, fastcomm-serve refuses to start ("no tokenizer"); this check then records that as a
failed check and, so the rest still runs, serves with `--tokenizer <derived config folder>
--skip-tokenizer-init`.

bench/device_gguf.sh serve runs it on the device (`timeout 540`, so the default budget is 500 s). Pure parts
(metrics parser, path scrubber, dry-run parser, process-group stop) are CPU-tested in test_serve_gpu_parts.py.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

MAX_TOKENS = 16
# Small and quick to start: no CUDA graphs or torch.compile (enforce-eager), a short context, little memory.
SETTINGS = ("--max-model-len", "1024", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.35",
            "--enforce-eager", "--seed", "0", "--dtype", "bfloat16")
CUDA_NOTE = "K-quant kernels: vllm-gguf-plugin's CUDA extension"
FALLBACK_WARNING = "slow Triton fallback"          # KernelStatus.warning(), wherever it is printed
SPEC = "vllm:spec_decode_"                         # vllm/v1/spec_decode/metrics.py (SpecDecodingProm)
LOG_TAIL = 40


class Stopped(BaseException):
    """SIGTERM (an outer `timeout`): unwinds through the finally blocks that stop the server."""


# ---- pure parts (CPU-tested) ----------------------------------------------------------------------------

_SAMPLE = re.compile(r'^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)'
                     r'(?:\{(?P<labels>(?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?'
                     r'\s+(?P<value>\S+)')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition -> (sample name, labels, value) per sample line; comments skipped."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        out.append((m["name"], dict(_LABEL.findall(m["labels"] or "")), value))
    return out


def spec_decode_counters(samples: Sequence[tuple[str, dict, float]]) -> dict:
    """vLLM's spec-decode counters summed over engines: drafts, draft_tokens, accepted_tokens and accepted
    per draft position. prometheus_client exposes a Counter `x` as `x_total` (and `x_created`, a time,
    which is not a count); both spellings of the count are accepted."""
    out: dict = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "accepted_per_position": {},
                 "found": False, "names": []}   # names: every spec-decode sample name seen (if vLLM renames one)
    keys = {"num_drafts": "drafts", "num_draft_tokens": "draft_tokens", "num_accepted_tokens": "accepted_tokens"}
    for name, labels, value in samples:
        if not name.startswith(SPEC) or name.endswith("_created"):
            continue
        if name not in out["names"]:
            out["names"].append(name)
        base = name[len(SPEC):].removesuffix("_total")
        if base == "num_accepted_tokens_per_pos":
            pos = labels.get("position", "?")
            out["accepted_per_position"][pos] = out["accepted_per_position"].get(pos, 0.0) + value
        elif base in keys:
            out[keys[base]] += value
            out["found"] = True
    return out


def scrub(value, roots: Mapping[str, str]):
    """``value`` (str, or lists / dicts of them) with each root path (absolute path -> label, e.g.
    OUTDIR -> "<tmp>") replaced by its label; the longest root first, so nested roots keep their own label.
    A root only matches whole path components, at both ends (/tmp/a is not replaced inside /tmp/ab, nor /tmp
    inside /var/tmp)."""
    if isinstance(value, str):
        for root, label in sorted(roots.items(), key=lambda kv: -len(kv[0])):
            if root and root != "/":
                value = re.sub(r"(?<![\w.~/-])" + re.escape(root.rstrip("/")) + r"(?=$|[/\s\"',:;=)\]}])",
                               lambda _: label, value)
        return value
    if isinstance(value, dict):
        return {scrub(k, roots): scrub(v, roots) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v, roots) for v in value]
    return value


_ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def option(argv: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in argv (last one given; `--x v` or `--x=v`)."""
    found = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.startswith(name + "="):
            found = a.split("=", 1)[1]
    return found


def parse_dry_run(stdout: str, stderr: str) -> dict:
    """fastcomm-serve --dry-run's output: the environment it sets, the command, its notes, and the choices
    read from the command (speculative config, tokenizer, config folder)."""
    lines = [l for l in stdout.strip().splitlines() if l.strip()]
    command = lines[-1] if lines else ""
    words = shlex.split(command)
    n_env = 0
    while n_env < len(words) and _ASSIGN.match(words[n_env]):
        n_env += 1
    argv = words[n_env:]
    spec = option(argv, "--speculative-config")
    try:
        spec = json.loads(spec) if spec is not None else None
    except ValueError:
        spec = {"unparsed": spec}
    return {"command": command, "env": dict(w.split("=", 1) for w in words[:n_env]), "argv": argv,
            "notes": [l.removeprefix("fastcomm-serve: ") for l in stderr.splitlines() if l.startswith("fastcomm-serve: ")],
            "speculative_config": spec, "tokenizer": option(argv, "--tokenizer"),
            "hf_config_path": option(argv, "--hf-config-path"), "tensor_parallel": option(argv, "--tensor-parallel-size")}


def chose_mtp(dry: dict) -> bool:
    """The dry run says MTP is on and the command carries an MTP speculative config."""
    spec = dry.get("speculative_config") or {}
    return spec.get("method") == "mtp" and any(n.startswith("MTP on") for n in dry.get("notes", ()))


def log_checks(log: str) -> dict:
    """What serve.log says about the K-quant kernels (and the MTP draft's embedding)."""
    return {"cuda_kernels_note": CUDA_NOTE in log, "fallback_warning_absent": FALLBACK_WARNING not in log,
            "fallback_lines": [l.strip()[-300:] for l in log.splitlines() if FALLBACK_WARNING in l][:3],
            "kernel_lines": [l.strip()[-300:] for l in log.splitlines() if CUDA_NOTE in l][:2],
            "draft_shares_gguf_embedding": "the MTP draft shares the target's GGUF-quantized embedding" in log}


def tail(path: Path, n: int = LOG_TAIL) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


# ---- the server process ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command() -> tuple[list[str], str]:
    """The `fastcomm-serve` console script when it runs this Python (this Python's scripts folder first,
    then PATH), else this Python's `-m fastcomm_vllm.serve` (the same main)."""
    import sysconfig

    for exe in (os.path.join(sysconfig.get_path("scripts"), "fastcomm-serve"), shutil.which("fastcomm-serve")):
        if not exe or not os.path.isfile(exe):
            continue
        try:
            with open(exe, "rb") as f:
                first = f.readline().decode(errors="replace")
            interp = first[2:].strip().split()[0] if first.startswith("#!") else ""
            if interp and os.path.samefile(interp, sys.executable):
                return [exe], f"console script {exe}"
        except (OSError, IndexError):
            continue
    return [sys.executable, "-m", "fastcomm_vllm.serve"], "python -m fastcomm_vllm.serve (no console script for this Python)"


def start(cmd: Sequence[str], env: Mapping[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        # Own session: vLLM's API server, engine core and workers all stop with one killpg.
        return subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)


def group_members(pgid: int) -> list[int] | None:
    """Live (not zombie) processes of process group ``pgid``, read from /proc; None where there is no /proc.
    Zombies are left out: they hold no GPU memory, and an orphan's is reaped by init, not by us."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    live = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()   # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(d.name))
    return live


def _group_alive(pgid: int) -> bool:
    members = group_members(pgid)
    if members is not None:
        return bool(members)
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def stop(proc: subprocess.Popen, grace: float = 20.0) -> dict:
    """SIGTERM the process group (vLLM shuts its engine down on it), SIGKILL what is left after ``grace``
    s, and wait (bounded) until no process of the group is left: a leftover engine process would hold the
    GPU's memory into the next start."""
    pgid, t0 = proc.pid, time.monotonic()
    _killpg(pgid, signal.SIGTERM)

    def wait_gone(seconds: float) -> bool:
        end = time.monotonic() + seconds
        while True:
            proc.poll()   # reap the leader, so it does not count as a member
            if not _group_alive(pgid):
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.2)

    killed = False
    if not wait_gone(grace):
        _killpg(pgid, signal.SIGKILL)
        killed = True
        wait_gone(10.0)
    if proc.poll() is None:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    return {"exit_code": proc.returncode, "sigkill": killed, "group_gone": not _group_alive(pgid),
            "stop_s": round(time.monotonic() - t0, 1)}


def http(url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def wait_healthy(proc: subprocess.Popen, base: str, deadline: float, poll_s: float = 2.0) -> dict:
    """Poll {base}/health until 200, the process exits (at once: no point waiting), or the deadline."""
    t0 = time.monotonic()
    last = None
    while True:
        rc = proc.poll()
        if rc is not None:
            return {"ok": False, "exited": rc, "after_s": round(time.monotonic() - t0, 1), "last_error": last}
        if time.monotonic() >= deadline:
            return {"ok": False, "timed_out": True, "after_s": round(time.monotonic() - t0, 1), "last_error": last}
        try:
            # The socket may be bound before the app serves: a per-request timeout keeps a poll from hanging.
            status, _ = http(base + "/health", timeout=min(5.0, max(0.5, deadline - time.monotonic())))
            if status == 200:
                return {"ok": True, "after_s": round(time.monotonic() - t0, 1)}
            last = f"HTTP {status}"
        except (urllib.error.URLError, OSError) as e:
            last = f"{type(e).__name__}: {e}"[:200]
        time.sleep(poll_s)


# ---- the check ------------------------------------------------------------------------------------------

def prompts(vocab: int) -> list[list[int]]:
    """Request 1: test_gguf_gpu's 128-token prompt (gpu_worker.prompt), so its tokens can be set beside the
    in-process GPU test's; request 2: a shorter one from another seed. Both below GLM's special tokens."""
    import random

    from gpu_worker import prompt

    rng = random.Random(99)
    return [prompt(vocab), [rng.randrange(vocab - 16) for _ in range(48)]]


def complete(base: str, model: str, ids: list[int], timeout: float) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "seed": 0}
    t0 = time.monotonic()
    try:
        status, text = http(base + "/v1/completions", body, timeout=timeout)
    except (urllib.error.URLError, OSError) as e:   # a timeout or a dropped connection: recorded, not raised
        status, text = None, f"{type(e).__name__}: {e}"
    res = {"prompt_len": len(ids), "status": status, "latency_s": round(time.monotonic() - t0, 2)}
    try:
        js = json.loads(text)
        choice = js["choices"][0]
        res.update(tokens=choice.get("token_ids"), text=choice.get("text"), finish_reason=choice.get("finish_reason"),
                   usage=js.get("usage"))
    except (ValueError, KeyError, IndexError, TypeError):
        res["body"] = text[-2000:]
    res["ok"] = status == 200 and isinstance(res.get("tokens"), list) and len(res["tokens"]) == MAX_TOKENS
    return res


def served(args: list[str], env: dict, log: Path, budget_end: float, health_timeout: float, vocab: int,
           want_drafts: bool) -> dict:
    """One server start: health, the two requests, /metrics; the process group stopped before returning."""
    port = free_port()
    cmd = [*args, "--host", "127.0.0.1", "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    res: dict = {"command": shlex.join(cmd), "port": port}
    with open(log, "a") as f:
        f.write(f"\n===== serve_gpu: {shlex.join(cmd)}\n")
    mark = log.stat().st_size
    t0 = time.monotonic()
    proc = start(cmd, env, log)
    try:
        # Keep 60 s of the budget for the requests and the shutdown.
        deadline = min(t0 + health_timeout, budget_end - 60)
        res["health"] = wait_healthy(proc, base, deadline)
        res["start_s"] = round(time.monotonic() - t0, 1)
        if not res["health"]["ok"]:
            return res
        try:
            status, text = http(base + "/v1/models", timeout=10)
            model = json.loads(text)["data"][0]["id"] if status == 200 else None
            res["served_model"] = model
            res["requests"] = [complete(base, model, ids, timeout=max(5.0, min(60.0, budget_end - 40 - time.monotonic())))
                               for ids in prompts(vocab)]
            # The stat loggers run in the API server as outputs arrive; a short poll covers any lag.
            until = time.monotonic() + (15 if want_drafts else 2)
            while True:
                status, text = http(base + "/metrics", timeout=10)
                counters = spec_decode_counters(parse_metrics(text)) if status == 200 else {"status": status}
                if not want_drafts or counters.get("drafts", 0) > 0 or time.monotonic() > until:
                    break
                time.sleep(1)
            res["spec_decode"] = counters
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:  # recorded; checks fail
            res["error"] = f"{type(e).__name__}: {e}"[-1000:]
    finally:
        res["stop"] = stop(proc)
        with open(log, "rb") as f:
            f.seek(mark)
            res["log_checks"] = log_checks(f.read().decode(errors="replace"))
        res["wall_s"] = round(time.monotonic() - t0, 1)
        if not (res.get("health") or {}).get("ok") or "error" in res or not all(r["ok"] for r in res.get("requests", [])):
            res["log_tail"] = tail(log)
    return res


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for d in ("fastcomm", "vllm", "torch", "transformers", "vllm-gguf-plugin", "gguf", "prometheus_client", "uvicorn"):
        try:
            out[d] = md.version(d)
        except md.PackageNotFoundError:
            out[d] = "not installed"
    return out


def dry_run(serve: list[str], first: Path, extra: list[str], env: dict) -> dict:
    r = subprocess.run([*serve, str(first), "--dry-run", *extra], capture_output=True, text=True, env=env, timeout=180)
    res = parse_dry_run(r.stdout, r.stderr) if r.returncode == 0 else {}
    res.update(exit_code=r.returncode, stderr_tail=r.stderr.strip().splitlines()[-8:] if r.returncode else [])
    return res


def run_check(out: Path, a: argparse.Namespace, t_start: float, results: dict) -> None:
    from fastcomm_vllm.gguf import synth as tinyglm

    budget_end = t_start + a.budget
    env = {**os.environ, "FASTCOMM_CACHE_DIR": str(out / "cache"), "PYTHONUNBUFFERED": "1"}
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ["FASTCOMM_CACHE_DIR"] = env["FASTCOMM_CACHE_DIR"]   # the same derived folder as the server's
    shape = tinyglm.Shape()
    first, _ = tinyglm.write_gguf(out / "model", shape)
    results["model"] = {"first_shard": str(first), "shards": len(list((out / "model").glob("*.gguf"))),
                        "mtp_block": shape.mtp, "vocab": shape.vocab}
    serve, how = serve_command()
    results["fastcomm_serve"] = how
    extra = [*SETTINGS, *(["--tensor-parallel-size", str(a.tp)] if a.tp else []), *shlex.split(a.serve_args)]
    if a.one_gpu:
        from fastcomm_vllm import one_gpu

        os.environ.update(one_gpu.environment())  # serve_args asks for test mode
        env.update(one_gpu.environment())
        options = one_gpu.serve_args(a.tp)
        # Every rank on the one GPU: --gpus so fastcomm-serve allows TP ranks on it, the harness's vLLM options.
        extra += ["--gpus", str(a.tp), *options]
        results["one_gpu"] = {"tp": a.tp, "vllm_options": options}
    checks = results["checks"]

    dry = dry_run(serve, first, extra, env)
    results["dry_run"] = dry
    tokenizer_args: list[str] = []
    if dry["exit_code"] != 0 and any("no tokenizer" in l for l in dry["stderr_tail"]):
        from fastcomm_vllm import gguf as fg

        folder = fg.plan(str(first), derive_tokenizer=False).config_dir
        tokenizer_args = ["--tokenizer", str(folder), "--skip-tokenizer-init"]
        results["tokenizer"] = "not derivable here: served with --skip-tokenizer-init (token-id prompts)"
        dry = dry_run(serve, first, extra + tokenizer_args, env)
        results["dry_run_skip_tokenizer"] = dry
        checks["tokenizer_derived"] = False
    else:
        derived = dry.get("tokenizer") is not None and dry.get("tokenizer") == dry.get("hf_config_path")
        results["tokenizer"] = "derived from the GGUF vocabulary" if derived else f"as the dry run says: {dry.get('tokenizer')}"
        checks["tokenizer_derived"] = derived
    checks["dry_run_ok"] = dry["exit_code"] == 0
    checks["dry_run_chose_mtp"] = dry["exit_code"] == 0 and chose_mtp(dry)
    if not checks["dry_run_ok"]:
        return

    args = [*serve, str(first), *extra, *tokenizer_args]
    mtp = served(args, env, out / "serve.log", budget_end, a.health_timeout, shape.vocab, want_drafts=True)
    results["mtp"] = mtp
    checks["server_healthy"] = bool(mtp.get("health", {}).get("ok"))
    reqs = mtp.get("requests", [])
    checks["completions_returned_tokens"] = len(reqs) == 2 and all(r["ok"] for r in reqs)
    sd = mtp.get("spec_decode", {})
    checks["mtp_drafted"] = sd.get("drafts", 0) > 0 and sd.get("draft_tokens", 0) > 0
    lc = mtp["log_checks"]
    checks["cuda_kernels"] = lc["cuda_kernels_note"] and lc["fallback_warning_absent"]
    checks["server_stopped"] = mtp["stop"]["group_gone"]

    if not a.compare_no_mtp:
        return
    # A second start costs about what the first did; start it only if that, plus requests, fits.
    need = mtp.get("start_s", a.health_timeout) * 1.3 + 60
    left = budget_end - time.monotonic()
    if not checks["server_healthy"] or left < need or not checks["server_stopped"]:
        why = ("the MTP server did not come up" if not checks["server_healthy"] else
               "the MTP server's processes did not all exit" if not checks["server_stopped"] else
               f"{left:.0f} s of the budget left, a second start needs ~{need:.0f} s")
        results["no_mtp"] = {"skipped": why}
        return
    plain = served([*args, "--no-mtp"], env, out / "serve.log", budget_end, a.health_timeout, shape.vocab,
                   want_drafts=False)
    results["no_mtp"] = plain
    got = [r.get("tokens") for r in plain.get("requests", [])]
    want = [r.get("tokens") for r in reqs]
    plain["identical"] = len(got) == 2 and got == want
    checks["no_mtp_healthy"] = bool(plain.get("health", {}).get("ok"))
    checks["no_mtp_identical_tokens"] = plain["identical"]
    checks["no_mtp_no_drafts"] = plain.get("spec_decode", {}).get("drafts", 0) == 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve_gpu.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:3]))
    p.add_argument("out", type=Path, metavar="OUTDIR", help="folder for serve.log, serve_gpu.json and the tiny model")
    p.add_argument("--compare-no-mtp", action="store_true",
                   help="also start with --no-mtp and require the same greedy tokens (skipped if the budget is short)")
    p.add_argument("--budget", type=float, default=500.0, help="seconds for the whole check (default 500)")
    p.add_argument("--health-timeout", type=float, default=300.0, help="seconds one start may take (default 300)")
    p.add_argument("--tp", type=int, default=None, help="--tensor-parallel-size (default: fastcomm-serve's, the GPU count)")
    p.add_argument("--one-gpu", action="store_true",
                   help="every rank of --tp on this one GPU (fastcomm_vllm.one_gpu, FASTCOMM_TEST_MODE=1)")
    p.add_argument("--serve-args", default="", metavar="'ARGS'",
                   help="more fastcomm-serve / vllm serve options for every start, one shell-quoted string")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if a.one_gpu and not (a.tp and a.tp >= 2):
        p.error("--one-gpu needs --tp N with N >= 2")
    t_start = time.monotonic()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(ROOT), str(ROOT / "integrations" / "vllm"), str(HERE)]

    def on_term(signum, frame):
        raise Stopped(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    results: dict = {"what": "fastcomm-serve end to end on the tiny GLM-5 GGUF (tests/gguf/serve_gpu.py)",
                     "argv": sys.argv[1:], "checks": {}, "versions": versions()}
    from fastcomm.measure import source_commit

    results["commit"] = source_commit(os.environ.get("FASTCOMM_COMMIT"))
    try:
        run_check(out, a, t_start, results)
    except (Exception, Stopped) as e:  # still write what was observed, and fail
        results["exception"] = f"{type(e).__name__}: {e}"[-4000:]
    results["wall_s"] = round(time.monotonic() - t_start, 1)
    checks = results["checks"]
    results["failures"] = [k for k, v in checks.items() if not v] + (["exception"] if "exception" in results else [])
    if not checks:
        results["failures"].append("nothing checked")
    roots = {str(out): "<tmp>", tempfile.gettempdir(): "<tmp>", str(ROOT): "<repo>",
             sys.executable: "<python>", os.path.expanduser("~"): "~"}
    (out / "serve_gpu.json").write_text(json.dumps(scrub(results, roots), indent=1))
    for k, v in checks.items():
        print(f"  {'ok  ' if v else 'FAIL'} {k}")
    skipped = (results.get("no_mtp") or {}).get("skipped")
    if skipped:
        print(f"  --no-mtp comparison skipped: {skipped}")
    print("FAILED: " + ", ".join(results["failures"]) if results["failures"] else "PASSED")
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
