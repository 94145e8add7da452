"""serve_gpu.py's parts that need no GPU: the /metrics parser, the path scrubber, the dry-run parser and log
checks (on fastcomm-serve's real output), the health poll and the process-group stop, and --help."""
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import serve_gpu
from conftest import installed, needs_gguf

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(not installed("prometheus_client"), reason="needs prometheus_client (vLLM's metrics library)")
def test_metrics_parser_reads_prometheus_client_text():
    # The exposition text comes from prometheus_client itself, with vLLM's metric and label names.
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    drafts = Counter("vllm:spec_decode_num_drafts", "drafts", labels, registry=reg)
    tokens = Counter("vllm:spec_decode_num_draft_tokens", "draft tokens", labels, registry=reg)
    accepted = Counter("vllm:spec_decode_num_accepted_tokens", "accepted", labels, registry=reg)
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "per pos", labels + ["position"], registry=reg)
    Gauge("vllm:num_requests_running", "running", labels, registry=reg).labels("m", "0").set(7)
    name = '/tmp/a "quoted" {braced} path.gguf'
    for engine, (d, t, a) in {"0": (31, 31, 4), "1": (2, 3, 1)}.items():
        drafts.labels(name, engine).inc(d)
        tokens.labels(name, engine).inc(t)
        accepted.labels(name, engine).inc(a)
        per_pos.labels(name, engine, "0").inc(a)
    text = generate_latest(reg).decode()
    samples = serve_gpu.parse_metrics(text)
    assert ("vllm:num_requests_running", {"model_name": "m", "engine": "0"}, 7.0) in samples
    got = serve_gpu.spec_decode_counters(samples)
    assert got["found"] and (got["drafts"], got["draft_tokens"], got["accepted_tokens"]) == (33, 34, 5)
    assert got["accepted_per_position"] == {"0": 5}
    # The `_created` samples (times) are in the text but are not counts.
    assert "vllm:spec_decode_num_drafts_created" in text


def test_metrics_without_spec_decode():
    got = serve_gpu.spec_decode_counters(serve_gpu.parse_metrics(
        "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0"} 0.0\nnot a sample line\n'))
    assert not got["found"] and got["drafts"] == 0


def test_scrub_replaces_whole_components_longest_first():
    roots = {"/tmp": "<tmp>", "/tmp/x/out": "<tmp>", "/work/repo": "<repo>", "/usr/bin/python3": "<python>"}
    value = {"cmd": "/usr/bin/python3 -m x /tmp/x/out/model/a.gguf --p=/work/repo/bench",
             "list": ["/tmp/y", "/tmp/xy", "/work/repository", '{"model":"/tmp/x/out/m.gguf"}', 3, None,
                      "/var/tmp/z"],
             "/tmp/x/out/key": True, "py": "/usr/bin/python3.12"}
    got = serve_gpu.scrub(value, roots)
    assert got == {"cmd": "<python> -m x <tmp>/model/a.gguf --p=<repo>/bench",
                   "list": ["<tmp>/y", "<tmp>/xy", "/work/repository", '{"model":"<tmp>/m.gguf"}', 3, None,
                            "/var/tmp/z"],
                   "<tmp>/key": True, "py": "/usr/bin/python3.12"}


def needs_serve(test):
    """fastcomm-serve's GGUF dry run: gguf, a real vLLM and the plugin."""
    skip = pytest.mark.skipif(not (installed("vllm") and installed("vllm_gguf_plugin")),
                              reason="needs vLLM and vllm-gguf-plugin")
    return needs_gguf(pytest.mark.vllm(skip(test)))


def _dry(capsys, monkeypatch, argv):
    from fastcomm_vllm import serve

    for name in ("FASTCOMM_VLLM", "VLLM_PLUGINS", "NCCL_P2P_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    # The entry point comes with the package's metadata (pyproject); this checkout's install may predate it.
    monkeypatch.setattr(serve, "_gguf_adapter_installed", lambda: True)
    rc = serve.main([*argv, "--gpus", "1", "--dry-run", *serve_gpu.SETTINGS])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return serve_gpu.parse_dry_run(out, err), err


@needs_serve
def test_dry_run_parsed_from_fastcomm_serve(capsys, monkeypatch, tiny):
    first = tiny[0]
    dry, err = _dry(capsys, monkeypatch, [str(first)])
    assert serve_gpu.chose_mtp(dry)
    assert dry["argv"][:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(first)]
    assert dry["speculative_config"]["model"] == str(first) and dry["env"] == {"FASTCOMM_VLLM": "1"}
    assert dry["tokenizer"] == dry["hf_config_path"] and dry["tensor_parallel"] == "1"
    assert len(dry["notes"]) == len(err.strip().splitlines())
    dry, _ = _dry(capsys, monkeypatch, [str(first), "--no-mtp"])
    assert not serve_gpu.chose_mtp(dry) and dry["speculative_config"] is None


@needs_serve
def test_log_checks_on_fastcomm_serve_output(capsys, monkeypatch, tiny):
    from fastcomm_vllm.gguf import kernels

    monkeypatch.setenv("VLLM_GGUF_USE_CUDA", "0")   # the plugin's switch: the fallback, and its warning
    _, err = _dry(capsys, monkeypatch, [str(tiny[0])])
    got = serve_gpu.log_checks(err)
    assert not got["fallback_warning_absent"] and not got["cuda_kernels_note"] and got["fallback_lines"]
    monkeypatch.delenv("VLLM_GGUF_USE_CUDA")
    _, err = _dry(capsys, monkeypatch, [str(tiny[0])])
    got = serve_gpu.log_checks(err)
    # Whether the extension loads here depends on this machine's torch; the check must agree with it.
    assert got["cuda_kernels_note"] == got["fallback_warning_absent"] == kernels.status().cuda


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_stop_kills_the_whole_group(tmp_path):
    # A leader whose child ignores SIGTERM: the child must still be gone when stop() returns. The child
    # writes its pid only once it ignores SIGTERM, so the test never stops a child that has not yet.
    pid_file = tmp_path / "child.pid"
    child_code = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  f"open({str(pid_file)!r} + '.tmp', 'w').write(str(os.getpid())); "
                  f"os.rename({str(pid_file)!r} + '.tmp', {str(pid_file)!r}); time.sleep(600)")
    proc = serve_gpu.start(_python(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {child_code!r}])
        time.sleep(600)
        """), os.environ, tmp_path / "log")
    deadline = time.monotonic() + 30
    while not pid_file.is_file() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    child = int(pid_file.read_text())
    assert set(serve_gpu.group_members(proc.pid)) == {proc.pid, child}
    res = serve_gpu.stop(proc, grace=1.0)
    assert res["group_gone"] and res["sigkill"] and proc.returncode is not None
    assert child not in (serve_gpu.group_members(proc.pid) or [])


def test_wait_healthy_stops_when_the_server_exits(tmp_path):
    proc = serve_gpu.start(_python("import sys; print('boom'); sys.exit(3)"), os.environ, tmp_path / "log")
    t0 = time.monotonic()
    res = serve_gpu.wait_healthy(proc, f"http://127.0.0.1:{serve_gpu.free_port()}", time.monotonic() + 120, poll_s=0.2)
    assert res["ok"] is False and res["exited"] == 3 and time.monotonic() - t0 < 30
    assert serve_gpu.tail(tmp_path / "log") == ["boom"]
    serve_gpu.stop(proc, grace=1.0)


def test_wait_healthy_sees_a_server_come_up(tmp_path):
    port = serve_gpu.free_port()
    proc = serve_gpu.start(_python(f"""
        import http.server, time
        time.sleep(1.0)   # not listening yet: the first polls are refused
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()
            def log_message(self, *a):
                pass
        http.server.HTTPServer(("127.0.0.1", {port}), H).serve_forever()
        """), os.environ, tmp_path / "log")
    try:
        res = serve_gpu.wait_healthy(proc, f"http://127.0.0.1:{port}", time.monotonic() + 60, poll_s=0.2)
        assert res["ok"], res
        assert serve_gpu.http(f"http://127.0.0.1:{port}/v1/nothing")[0] == 404
    finally:
        assert serve_gpu.stop(proc, grace=5.0)["group_gone"]


def test_wait_healthy_has_a_deadline(tmp_path):
    proc = serve_gpu.start(_python("import time; time.sleep(600)"), os.environ, tmp_path / "log")
    try:
        t0 = time.monotonic()
        res = serve_gpu.wait_healthy(proc, f"http://127.0.0.1:{serve_gpu.free_port()}", time.monotonic() + 1.5,
                                     poll_s=0.2)
        assert res.get("timed_out") and time.monotonic() - t0 < 10
    finally:
        serve_gpu.stop(proc, grace=1.0)


def test_help_runs_without_vllm_or_a_gpu():
    r = subprocess.run([sys.executable, str(HERE / "serve_gpu.py"), "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--compare-no-mtp" in r.stdout and "--budget" in r.stdout and "OUTDIR" not in r.stderr
    # Nothing heavy at import: --help must not have pulled in vLLM or torch.
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import serve_gpu; "
            "print(json.dumps(sorted(m for m in ('vllm', 'torch', 'gguf') if m in sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code, str(HERE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


FAKE_SERVER = '''
import http.server, json, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
print("fastcomm-serve: K-quant kernels: vllm-gguf-plugin's CUDA extension (fake)", flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def reply(self, code, body, kind="application/json"):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health":
            self.reply(200, "")
        elif self.path == "/v1/models":
            self.reply(200, json.dumps({"data": [{"id": "tiny"}]}))
        elif self.path == "/metrics":
            self.reply(200, 'vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 30.0\\n'
                            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 30.0\\n'
                            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 2.0\\n', "text/plain")
        else:
            self.reply(404, "{}")
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if req.get("model") != "tiny" or not req.get("return_token_ids"):
            return self.reply(400, json.dumps({"error": "bad request"}))
        ids = [(sum(req["prompt"]) + i) % 1024 for i in range(req["max_tokens"])]
        self.reply(200, json.dumps({"choices": [{"token_ids": ids, "text": "", "finish_reason": "length"}]}))
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_served_against_a_fake_openai_server(tmp_path):
    # The HTTP half of the check (health, models, completions, metrics, stop) against a stand-in server.
    fake = tmp_path / "fake.py"
    fake.write_text(FAKE_SERVER)
    log = tmp_path / "serve.log"
    log.write_text("")
    res = serve_gpu.served([sys.executable, str(fake)], dict(os.environ), log, time.monotonic() + 120, 60.0, 1024,
                           want_drafts=True)
    assert res["health"]["ok"] and res["served_model"] == "tiny" and "error" not in res, res
    prompts = serve_gpu.prompts(1024)
    assert [r["tokens"] for r in res["requests"]] == [[(sum(p) + i) % 1024 for i in range(serve_gpu.MAX_TOKENS)]
                                                      for p in prompts]
    assert all(r["ok"] for r in res["requests"]) and res["spec_decode"]["drafts"] == 30
    assert res["log_checks"]["cuda_kernels_note"] and res["log_checks"]["fallback_warning_absent"]
    assert res["stop"]["group_gone"] and "log_tail" not in res
