#!/usr/bin/env bash
# GLM-5 GGUF on the device (H200, torch 2.11.0+cu130, Python 3.12, nvcc, no network): install
# vllm-gguf-plugin with its CUDA extension built for that torch, check the extension loads, time one K-quant
# GEMV with the CUDA kernel and with the Triton fallback, and run the GGUF GPU test (tests/gguf/test_gguf_gpu.py:
# prefill vs a bf16 reference with a swapped-shard control, greedy with and without MTP), and (mode serve)
# `fastcomm-serve` end to end over HTTP (tests/gguf/serve_gpu.py). Results under $OUT.
#
# Why a build: the PyPI wheel's extension (stable ABI, abi3) is built against torch 2.14's stable-ABI shim
# and fails under torch 2.11 with `undefined symbol torch_exception_get_what_without_backtrace`; the plugin
# then falls back to Triton without a word. Being abi3 (py_limited_api, cp310), an extension built against
# torch 2.11.0's headers on ANY x86-64 Linux with Python >= 3.10 and nvcc 13 loads on the device's 3.12.
#
# 1. Here, once (no device time; needs pip's network and nvcc 13):
#        echo /.gguf_stage/ >> "$(git rev-parse --git-path info/exclude)"
#        bench/device_gguf.sh prepare .gguf_stage
#    It downloads the plugin's sdist and gguf's wheel, and builds the plugin wheel for sm_90 against
#    torch 2.11.0+cu130 (PyPI's torch 2.11.0 is that build) in a scratch venv it removes afterwards
#    (~3 GB of downloads, ~1 min of nvcc per arch). The folder holds ~1.3 MB. For other GPUs set
#    TORCH_CUDA_ARCH_LIST (e.g. "9.0;10.0;12.0" for H100/H200, B200 and RTX PRO 6000).
# Every mode: prefix FASTCOMM_COMMIT=<sha> so logs and JSON name the tree that ran (the device's copy of
# the checkout can carry stale git metadata: once it stamped an older commit).
# 2. On the device, after vLLM 0.25.0 is staged (notes/VLLM_ON_DEVICE.md, calls 1-5), one call with
#    carry [".gguf_stage", ".stage/install.sh"]:
#        eval "$(bash .stage/install.sh)" && bash bench/device_gguf.sh run .gguf_stage
#    Without a prebuilt wheel in .gguf_stage it builds from the sdist there (TORCH_CUDA_ARCH_LIST=9.0).
#    `device_gguf.sh install .gguf_stage` only installs (then bench/device_run.sh's GPU stage runs the GGUF
#    GPU tests too, instead of skipping them).
# 3. The figures, each one call on the same warm machine (carry .gguf_stage and .stage/install.sh, then
#    eval "$(bash .stage/install.sh)" first):
#        bash bench/device_gguf.sh model .gguf_stage        # writes the full-width 78-layer GGUF (~41 GB) to $MODEL_DIR
#        bash bench/device_gguf.sh figures .gguf_stage gguf # its decode at TP 1, concurrency 1,2,3,4,8
#        (FIGURE_TP=2 on a two-GPU machine: TP 2, fastcomm's all-reduce beside vLLM's; not yet run, none lent)
#        bash bench/device_gguf.sh figures .gguf_stage mtp  # the same with MTP, 3 draft tokens, one request (~8 min)
#        bash bench/device_gguf.sh figures .gguf_stage fp8  # the same shapes as FP8 (dummy weights)
#        bash bench/device_gguf.sh figures .gguf_stage fp8-spread  # the same, routers drawn as the GGUF file's
#        bash bench/device_gguf.sh figures .gguf_stage gguf-profile   # then fp8-profile: kernels per step
#    (PROFILE_CONCURRENCY=8 for the 8-request step), each ~6 min with the engine's start-up.
#    Why concurrency 2-4: a verify step of k draft tokens is a forward over k + 1 tokens of one request,
#    which reads the weights as a decode step of k + 1 requests does (bench/predict_mtp.py uses that).
# 3b. fastcomm's K-quant decode kernels (csrc/kquant/kquant.cu; one call, ~3 min): tests/gguf/test_kquant_gpu.py, then
#    python -m fastcomm_bench.gguf_kernels (plugin vs fastcomm per product at GLM-5's shapes, $OUT/gguf-kernels.json):
#        eval "$(bash .stage/install.sh)" && bash bench/device_gguf.sh kquant .gguf_stage
#    KQUANT_TOKENS=8,16,64,256 adds a prefill's products: the plugin's against the weights dequantized for the
#    tensor cores (FASTCOMM_GGUF_DEQUANT_*) and fastcomm's kernels 8 tokens a call
#    (FASTCOMM_GGUF_CHUNK_MAX_TOKENS); --suggest on the JSON says from / up to how many tokens they win.
#    KQUANT_K="staged" runs only the tests pytest -k selects; KQUANT_SM120=0 skips the sm_120-capped table;
#    KQUANT_TESTS=0 skips the tests; KQUANT_TP=8 times one rank's products at TP 8 (gguf_kernels --tp).
#    Each table's forms table beside it ($OUT/gguf-kernels-forms.json; fastcomm.kquant.forms): a GPU's, timed
#    at KQUANT_TP=8 KQUANT_TOKENS=1,2,3,4,5,6,7,8 (KQUANT_TABLE_TIMEOUT_S=540), goes to fastcomm/kquant/tables/.
#    The figures above take fastcomm's kernels by default; FASTCOMM_GGUF_KERNELS=plugin gives the plugin's.
# 3c. A/B of kernel variants, committed revisions side by side in one call (no vLLM needed; ~90 s a tree):
#    here, `bench/device_gguf.sh ab-prepare .gguf_stage REV...` writes each revision's tree (git archive) into the
#    folder beside its gguf wheel; on the device, carry [".gguf_stage"]:
#        AB_TESTS=1 AB_TOKENS=4,8 bash bench/device_gguf.sh ab .gguf_stage REV...
#    runs the GPU tests on the first tree (AB_TESTS set) and python -m fastcomm_bench.gguf_kernels on each
#    ($OUT/kernels-REV.{json,txt}, tests-REV.log). Why in one call: the same GPU, clocks and minute for every tree.
#    AB_TAG=-x names a second table of the same trees (e.g. FASTCOMM_GGUF_PDL=0 AB_TAG=-nopdl: kernels-REV-nopdl).
#    Here, `python -m fastcomm_bench.gguf_kernels --compare kernels-A.json kernels-B.json` sets two side by side.
#    Where a kernel's time goes (ncu, one call, carry .gguf_stage; no vLLM): bash bench/device_gguf.sh ncu .gguf_stage
#    profiles the grouped MoE and o_proj at 8 tokens (NCU_OPS=op:form:kernel-regex;..., NCU_TOKENS) into
#    $OUT/ncu-OP-FORM.txt, through python -m fastcomm_bench.kquant_profile.
# 3d. Tensor parallel 1-8 with every rank on this one GPU (fastcomm_vllm.one_gpu; one call per part set,
#    same carry):  TP_PARTS=ref,tp1,tp2 bash bench/device_gguf.sh tp .gguf_stage   (then logits1,tp4; tp8,control8; skew4)
#    $OUT/tp/engines.tgz (each engine's JSON and log), $OUT/tp/report.json: logits vs bf16 and TP 1, MTP, all-reduce counts.
# 3e. One TP 8 rank's decode step (issue 36), each one call on a warm machine, the shard written once (~55 GiB in
#    /dev/shm or on /tmp's disk): bash bench/device_gguf.sh shard .gguf_stage write   (then plain, plugin, mtp)
#    SHARD_STANDIN_US (0,5,10,20,60): the stand-in all-reduce's times; the step at each, in one engine; plain
#    profiles the steps of 1, 2 and 4 requests (SHARD_PROFILE_CONCURRENCY) at the first time after them. On an
#    H100 the products take the shipped forms table (fastcomm/kquant/tables/; FASTCOMM_GGUF_FORMS=none for the
#    thresholds alone, the A/B of a table). The engine's run is bounded by SHARD_BUDGET_S
#    (560 s from the call's start: a deadline bench-decode holds after its own set-up too), so a call cut short
#    still brings back what it measured. SHARD_PROFILE=0: no profile (a sweep under the caller's FASTCOMM_GGUF_*
#    settings).
# 4. `fastcomm-serve` itself, end to end (one call, same carry; ~2-4 min, bounded at 540 s):
#        eval "$(bash .stage/install.sh)" && bash bench/device_gguf.sh serve .gguf_stage
#    tests/gguf/serve_gpu.py: the tiny GLM-5 GGUF (3 shards + MTP block) through `fastcomm-serve --dry-run`
#    (must choose MTP), then served over HTTP: /health, two greedy /v1/completions, /metrics' spec-decode
#    drafts > 0, the CUDA K-quant kernels in the log (no Triton-fallback warning). Results in
#    $OUT/serve/serve_gpu.json and serve.log. SERVE_GPU_ARGS adds options, e.g. "--compare-no-mtp" (a
#    second start with --no-mtp, greedy tokens must match; only if the budget holds it).
set -uo pipefail
mode=${1:?usage: device_gguf.sh prepare|run|kquant|model|figures|serve|ab-prepare|ab|ncu DIR}
dir=${2:?usage: device_gguf.sh prepare|run|kquant|model|figures|serve|ab-prepare|ab|ncu DIR}
here=$(cd "$(dirname "$0")/.." && pwd)
PLUGIN=vllm-gguf-plugin==0.0.5
GGUF=gguf==0.19.0
# `vllm serve` needs what the offline engine does not (the device's staged vLLM set is for vllm.LLM):
# import name=pinned wheel; installed only where the import fails.
SERVE_DEPS=(uvicorn=uvicorn==0.54.0 h11=h11==0.16.0 click=click==8.5.1 anyio=anyio==4.16.0
  watchfiles=watchfiles==1.3.0 httptools=httptools==0.9.0 httpx=httpx==0.28.1 httpcore=httpcore==1.0.9
  certifi=certifi==2026.10.19.post1 idna=idna==3.20 annotated_doc=annotated-doc==0.0.7
  prometheus_fastapi_instrumentator=prometheus-fastapi-instrumentator==8.1.0
  model_hosting_container_standards=model-hosting-container-standards==0.1.16 jmespath=jmespath==1.1.0
  supervisor=supervisor==4.3.0)

cuda_home() {   # the toolkit holding nvcc and libcudart.so (an nvcc on PATH may be a wrapper script)
  if [ -n "${CUDA_HOME:-}" ]; then echo "$CUDA_HOME"; return; fi
  if [ -x /usr/local/cuda/bin/nvcc ]; then echo /usr/local/cuda; return; fi
  dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"
}

prepare() {
  set -e
  mkdir -p "$dir"
  local py=${PYTHON:-python3} venv="$dir/.build-venv"
  "$py" -m pip download -q --no-deps --only-binary=:all: -d "$dir" "$GGUF"
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$dir/serve-wheels" "${SERVE_DEPS[@]#*=}"
  # The sdist's metadata step imports torch: fetch it with a pip that has torch, without building.
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q "setuptools>=77,<81" wheel
  # The build imports torch, and torch's import loads its CUDA libraries (cuDNN, NCCL...): the whole
  # torch 2.11.0 (+cu130 on PyPI) with its nvidia-* wheels, about 3 GB, in the scratch venv only.
  "$venv/bin/pip" install -q torch==2.11.0 numpy
  "$venv/bin/pip" download -q --no-deps --no-binary=:all: --no-build-isolation -d "$dir" "$PLUGIN"
  # CUDA_HOME: nvcc's toolkit (with libcudart.so to link), not the nvidia-cuda-runtime wheel torch brought.
  CUDA_HOME=$(cuda_home) TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-4} \
    "$venv/bin/pip" wheel -q --no-deps --no-build-isolation -w "$dir" "$dir"/vllm_gguf_plugin-0.0.5.tar.gz
  rm -rf "$venv"
  ls -l "$dir"
}

install() {   # gguf and the plugin (idempotent: a second call on the same machine is quick)
  cd "$here"
  export PYTHONPATH="$here:$here/integrations/vllm${PYTHONPATH:+:$PYTHONPATH}"
  export VLLM_USE_FLASHINFER_SAMPLER=0
  echo "== $(date -u) ${FASTCOMM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo no-git)} on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  python -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])'
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "== pip install -e . failed"
  # Already installed on this machine, with the CUDA kernels loading: nothing to do.
  python -c 'import gguf, sys; from fastcomm_vllm.gguf import kernels; sys.exit(0 if kernels.status().cuda else 1)' \
    2>/dev/null && return 0
  python -m pip install -q --no-index --no-deps --find-links "$dir" "$GGUF" || return 1
  local wheel
  wheel=$(ls "$dir"/vllm_gguf_plugin-0.0.5-*.whl 2>/dev/null | head -1)
  local t0=$SECONDS
  if [ -n "$wheel" ]; then
    echo "== installing the prebuilt $(basename "$wheel")"
    python -m pip install -q --no-index --no-deps --force-reinstall "$wheel" || return 1
  else
    echo "== building the extension from the sdist (sm_90)"
    CUDA_HOME=$(cuda_home) TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python -m pip install -q --no-index --no-deps --no-build-isolation \
      --force-reinstall "$dir"/vllm_gguf_plugin-0.0.5.tar.gz || return 1
  fi
  echo "== plugin installed in $((SECONDS - t0)) s"
}

MODEL_DIR=${MODEL_DIR:-/tmp/glm5-78L-16E-gguf}
MODEL_FIRST=$MODEL_DIR/GLM-5-78L-16E-UD-Q4_K_XL-00001-of-00004.gguf

model() {
  install || return 1
  if [ -f "$MODEL_FIRST" ]; then echo "== $MODEL_FIRST exists"; return 0; fi
  local t0=$SECONDS
  python -m fastcomm_bench.glm5_gguf "$MODEL_DIR" --full --shards 4 || return 1
  echo "== written in $((SECONDS - t0)) s"
}

shard_dir() {   # where the ~55 GiB TP 8 shard fits: /dev/shm (host memory; fast to write), else /tmp's disk
  local need=$((60 * 1000 * 1000 * 1000)) d
  for d in ${SHARD_DIR:-/dev/shm /tmp}; do
    [ -f "$d/glm5-tp8-shard/$SHARD_FIRST_NAME" ] && { echo "$d/glm5-tp8-shard"; return 0; }
    [ "$(df -B1 --output=avail "$d" 2>/dev/null | tail -1)" -gt "$need" ] 2>/dev/null && { echo "$d/glm5-tp8-shard"; return 0; }
  done
  return 1
}
SHARD_FIRST_NAME=GLM-5-TP8-rank0-UD-Q4_K_XL-00001-of-00008.gguf

# Issue 36: rank 0 of GLM-5 at TP 8 (python -m fastcomm_bench.glm5_gguf --tp8-shard) as a TP 1 engine, a stand-in
# kernel at each of the step's all-reduce sites (fastcomm_vllm.standin) timed at SHARD_STANDIN_US in one engine.
#   shard write: the shard file only (a call of its own: ~60 GB written)
#   shard plain: one request and 2-4 (the verify steps' token counts), CUDA graphs at vLLM's default sizes, then
#                the profiles of 1, 2 and 4 requests' steps (SHARD_PROFILE_CONCURRENCY; profile_summary), stand-in
#                at the first time
#   shard plugin: one request with vllm-gguf-plugin's kernels (as the user's NCCL figures ran), stand-in 0 and 20
#   shard mtp:   one request with 3 MTP drafts (random weights accept none: the drafts' cost)
shard() {
  local what=${1:-plain} out=${OUT:-$here/out} t_call=$SECONDS
  install || return 1
  local sdir
  sdir=$(shard_dir) || { echo "== no disk or /dev/shm with 60 GB free for the TP 8 shard"; df -h /tmp /dev/shm; return 1; }
  if [ ! -f "$sdir/$SHARD_FIRST_NAME" ]; then
    local t0=$SECONDS
    python -m fastcomm_bench.glm5_gguf "$sdir" --tp8-shard --shards 8 || return 1
    echo "== TP 8 shard written to ${sdir%%/glm5*} in $((SECONDS - t0)) s"
  fi
  [ "$what" = write ] && return 0
  local us=${SHARD_STANDIN_US:-0,5,10,20,60}
  local left=$(( ${SHARD_BUDGET_S:-560} - (SECONDS - t_call) ))
  # Three timed runs a point: their median drops one slow run (f893d0e's single request: 0.93 and 1.03 s).
  local common=(--tp 1 --max-tokens "${SHARD_TOKENS:-64}" --capture-sizes default --repeats "${SHARD_REPEATS:-3}"
    --max-model-len 2048 --max-num-batched-tokens 2048 --sweep-temperature 1
    --deadline "$(( $(date +%s) + left ))")
  case "$what" in
    plain)
      # The floor: the weight bytes one request's step reads (synth.step_read_bytes: 8 of 256 experts, no
      # MTP block) at this GPU's device-to-device copy bandwidth (bytes read + written over the time), measured here.
      local gbps wbytes
      gbps=$(python -c 'import torch; x = torch.empty(2**31, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(True), torch.cuda.Event(True); s.record()
for _ in range(10): y.copy_(x)
e.record(); e.synchronize(); print(round(2 * 10 * x.numel() / (s.elapsed_time(e) * 1e6), 1))')
      wbytes=$(python -c 'from fastcomm_vllm.gguf import synth; print(synth.step_read_bytes(synth.TP8_SHARD))')
      echo "== copy bandwidth ${gbps} GB/s; shard weights ${wbytes} B"
      # The profiles at N requests (a verify step of N - 1 drafts) against their own floor: top 8 of 256
      # experts a token, distinct across the step's tokens (synth's routers), so 8 N experts read.
      local pc=${SHARD_PROFILE_CONCURRENCY:-1,2,4} n nbytes
      for n in ${pc//,/ }; do
        [ "$n" = 1 ] && continue
        nbytes=$(python -c 'import sys; from fastcomm_vllm.gguf import synth; s = synth.TP8_SHARD
print(synth.step_read_bytes(s, min(s.experts, s.top_k * int(sys.argv[1]))))' "$n")
        export "PROFILE_SUMMARY_ARGS_C$n=--weight-bytes $nbytes --copy-gbps $gbps"
      done
      # The floor's inputs as a record of their own (predict_mtp reads them beside the step's record).
      python -c 'import json, sys, torch; print(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbps": float(sys.argv[1]), "weight_bytes": int(sys.argv[2])}))' \
        "$gbps" "$wbytes" > "$out/shard-floor.json"
      local prof=(--profile-dir /tmp/prof-shard --profile-concurrency "$pc" --profile-tokens 16)
      [ "${SHARD_PROFILE:-1}" = 0 ] && prof=()   # a policy's sweep only (e.g. FASTCOMM_GGUF_* set by the caller)
      PROFILE_SUMMARY_ARGS="--weight-bytes $wbytes --copy-gbps $gbps" bash bench/device_decode.sh shard-tp8 "$sdir/$SHARD_FIRST_NAME" vllm "${common[@]}" --no-mtp \
             --concurrency "${SHARD_CONCURRENCY:-1,2,3,4}" --standin-us "$us" "${prof[@]}" ;;
    # The same step with vllm-gguf-plugin's kernels (FASTCOMM_GGUF_KERNELS=plugin), as the user's NCCL figures
    # ran: the C that the validation against the user's 43 / 57 tok/s needs.
    plugin) FASTCOMM_GGUF_KERNELS=plugin bash bench/device_decode.sh shard-tp8-plugin "$sdir/$SHARD_FIRST_NAME" vllm \
              "${common[@]}" --no-mtp --concurrency 1 --standin-us "${SHARD_PLUGIN_STANDIN_US:-0,20}" ;;
    mtp) bash bench/device_decode.sh shard-tp8-mtp3 "$sdir/$SHARD_FIRST_NAME" vllm "${common[@]}" --mtp 3 \
           --concurrency 1 --max-num-seqs 1 --standin-us "${SHARD_MTP_STANDIN_US:-0,20}" ;;
    *) echo "shard: write, plain, plugin or mtp" >&2; return 2 ;;
  esac
}

figures() {   # one row set per call: gguf | mtp | fp8 | fp8-spread | gguf-profile | fp8-profile
  local what=${1:?figures needs gguf, mtp, fp8, fp8-spread, gguf-profile or fp8-profile} out=${OUT:-$here/out}
  install || return 1
  # FIGURE_TP (default 1): tensor parallel over that many GPUs (the issue's TP 2 on a two-GPU machine), where the
  # rows are fastcomm's all-reduce beside vLLM's own (FIGURE_CONFIGS, default vllm at TP 1).
  local tp=${FIGURE_TP:-1}
  local cfgs=${FIGURE_CONFIGS:-$([ "$tp" = 1 ] && echo vllm || echo fastcomm-nofuse,vllm)}
  # FIGURE_SWEEP_TEMPERATURE (default 1): the concurrency sweep samples, a seed a request, so 8 requests decode
  # different tokens and their step reads the experts 8 real requests would (greedy decoding of random weights
  # gives every request the same few tokens); 0: greedy, as the runs before 2026-12-03.
  # FIGURE_BATCHED_TOKENS (default 2048, the model length): vLLM's start-up profiles memory with a prefill of
  # that many tokens (its own default, 16384, took 63 s of the GGUF's 306 s start-up on 2026-12-03).
  local batched=(--max-num-batched-tokens "${FIGURE_BATCHED_TOKENS:-2048}")
  local sweep=(--sweep-temperature "${FIGURE_SWEEP_TEMPERATURE:-1}" "${batched[@]}")
  local common=(--tp "$tp" --max-tokens 128 --capture-sizes 1,2,3,4,8 --repeats "${FIGURE_REPEATS:-3}"
    --max-model-len 2048 "${sweep[@]}")
  # FIGURE_CONCURRENCY (default 1,2,3,4,8) and FIGURE_REPEATS (3) trim a run to fit one call on a fresh machine.
  local conc=${FIGURE_CONCURRENCY:-1,2,3,4,8}
  case "$what" in
    gguf) bash bench/device_decode.sh "gguf-tp$tp" "$MODEL_FIRST" "$cfgs" "${common[@]}" --no-mtp \
            --concurrency "$conc" ;;
    # One request, so one capture size beside the verify's 4 tokens and one timed repeat: with the draft model's
    # start-up, the sweep's settings ran past a 560 s call (2026-12-02) and returned nothing.
    mtp) bash bench/device_decode.sh "gguf-mtp3-tp$tp" "$MODEL_FIRST" "$cfgs" --tp "$tp" --max-tokens 128 \
           --capture-sizes 1,4 --repeats "${FIGURE_REPEATS:-1}" --max-model-len 2048 --mtp 3 --concurrency 1 \
           --max-num-seqs 1 "${batched[@]}" ;;
    fp8) bash bench/device_decode.sh "fp8-tp$tp" glm5-78L-16E "$cfgs" "${common[@]}" --quantization fp8 \
           --concurrency "$conc" ;;
    # FP8 with its routers re-drawn as the GGUF file's (--spread-routing): vLLM 0.25's dummy router sends every
    # token to the same 8 experts, so its 8-request step reads half the experts the GGUF one does.
    fp8-spread) bash bench/device_decode.sh "fp8s-tp$tp" glm5-78L-16E "$cfgs" "${common[@]}" --quantization fp8 \
                  --spread-routing --concurrency "$conc" ;;
    # Where each step's GPU time goes (profile_summary: busiest kernels per step), GGUF against FP8 on the
    # same shapes, at PROFILE_CONCURRENCY requests (default 1, the single-request goal): one call each.
    gguf-profile|fp8-profile)
      local c=${PROFILE_CONCURRENCY:-1} kind=${what%-profile}
      local prof=(--concurrency "$c" --profile-dir "/tmp/prof-$kind-c$c" --profile-concurrency "$c" --profile-tokens 16
        --max-tokens 64 --tp 1 --capture-sizes 1,2,4,8 --repeats 1 --max-model-len 2048 "${sweep[@]}")
      if [ "$kind" = gguf ]; then
        bash bench/device_decode.sh "gguf-prof-c$c" "$MODEL_FIRST" vllm "${prof[@]}" --no-mtp
      else
        bash bench/device_decode.sh "fp8-prof-c$c" glm5-78L-16E vllm "${prof[@]}" --quantization fp8
      fi ;;
    *) echo "figures: gguf, mtp, fp8, fp8-spread, gguf-profile or fp8-profile" >&2; return 2 ;;
  esac
}

run() {
  local out=${OUT:-$here/out}
  mkdir -p "$out"
  exec > >(tee "$out/device_gguf.log") 2>&1
  install || return 1
  python - <<'PY' | tee "$out/kernels.txt"
from fastcomm_vllm.gguf import kernels
s = kernels.status()
print("CUDA extension:", "loads" if s.cuda else "DOES NOT LOAD", "-", s.detail)
PY
  python - <<'PY' | tee "$out/gemv.txt"
# One 6144 x 2048 Q4_K GEMV (the issue's shape), CUDA kernel vs the plugin's Triton fallback.
import numpy as np, torch, gguf
from vllm_gguf_plugin import ops
rows, cols = 6144, 2048
block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K]
rng = np.random.default_rng(0)
raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
raw[..., 0:2] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
raw[..., 2:4] = np.frombuffer(np.float16(7.5e-4).tobytes(), np.uint8)
w = torch.from_numpy(raw.reshape(rows, -1)).cuda()
x = torch.randn(1, cols, dtype=torch.bfloat16, device="cuda")
qt = int(gguf.GGMLQuantizationType.Q4_K)
def timed(fn, n=200):
    for _ in range(10): fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n): fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1000
ref = (x.float() @ torch.from_numpy(gguf.quants.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType.Q4_K)).cuda().T)
tri = ops.ggml_mul_mat_a8_triton(w, x, qt, rows)
print(f"triton  Q4_K GEMV {rows}x{cols}: {timed(lambda: ops.ggml_mul_mat_a8_triton(w, x, qt, rows)):.1f} us, "
      f"rel err {float((tri.float() - ref).norm() / ref.norm()):.4f}")
if hasattr(torch.ops, "_C_gguf") and hasattr(torch.ops._C_gguf, "ggml_mul_mat_vec_a8"):
    cu = torch.ops._C_gguf.ggml_mul_mat_vec_a8(w, x, qt, rows)
    print(f"CUDA    Q4_K GEMV {rows}x{cols}: {timed(lambda: torch.ops._C_gguf.ggml_mul_mat_vec_a8(w, x, qt, rows)):.1f} us, "
          f"rel err {float((cu.float() - ref).norm() / ref.norm()):.4f}")
else:
    print("CUDA    kernel not available")
print(f"weight bytes {w.numel() / 1e6:.1f} MB: {w.numel() / 4.8e12 * 1e6:.1f} us at 4.8 TB/s")
PY
  echo "== GGUF GPU test"
  timeout 480 python tests/gguf/test_gguf_gpu.py "$out/gguf" ${GGUF_PARTS:-prefill,mtp}
  local rc=$?
  rm -rf "$out/gguf/cache" "$out"/gguf/*/gguf "$out"/gguf/*/ref   # the models: regenerated from the seed
  echo "== GPU test exit $rc; results: $out/gguf/gguf_gpu.json"
  return $rc
}

kernel_tests() {   # the tree in the current folder: its K-quant GPU tests (KQUANT_K: pytest -k), the log's tail into $1
  # every test twice: the GPU's own limits and sm_120's (the limits fixture)
  timeout 420 python -m pytest -q -p no:cacheprovider --durations=8 ${KQUANT_K:+-k "$KQUANT_K"} \
    tests/gguf/test_kquant_gpu.py 2>&1 \
    | tail -n 40 | tee "$1"
  local rc=${PIPESTATUS[0]}
  echo "== kquant GPU test exit $rc"
  return "$rc"
}

kernel_table() {   # the tree in the current folder: the kernel table at $1 tokens, into $2.json and $2.txt, and
  # its forms table into $2-forms.json (fastcomm.kquant.forms: a GPU's goes to fastcomm/kquant/tables/; a tree
  # from before forms tables, as `ab` may run, writes none)
  local forms=()
  grep -q -- "--forms-out" bench/gguf_kernels.py && forms=(--forms-out "$2-forms.json")
  timeout "${KQUANT_TABLE_TIMEOUT_S:-300}" python -m fastcomm_bench.gguf_kernels --tokens "$1" --tp "${KQUANT_TP:-1}" \
    --json "$2.json" "${forms[@]}" > "$2.txt" 2>&1
  local rc=$?
  tail -n 40 "$2.txt"
  return $rc
}

kquant() {   # fastcomm's K-quant decode kernels: GPU test, then plugin-vs-fastcomm timings at GLM-5's shapes
  local out=${OUT:-$here/out}
  mkdir -p "$out"
  exec > >(tee "$out/kquant.log") 2>&1
  install || return 1
  export FASTCOMM_CACHE_DIR=${FASTCOMM_CACHE_DIR:-/tmp/fastcomm-cache}
  local rc=0
  if [ "${KQUANT_TESTS:-1}" = 1 ]; then kernel_tests "$out/kquant-tests.log" || rc=1; fi
  kernel_table "${KQUANT_TOKENS:-1,2,4,8}" "$out/gguf-kernels" || rc=1
  # The same table with the launches planned for an RTX PRO 6000 (188 SMs, 99 KB a block): the forms and
  # warps sm_120 gets, timed on this GPU under that cap (KQUANT_SM120=0 skips it).
  if [ "${KQUANT_SM120:-1}" = 1 ]; then
    FASTCOMM_TEST_MODE=1 FASTCOMM_TEST_DEVICE_LIMITS=sm_120 kernel_table "${KQUANT_TOKENS:-1,2,4,8}" \
      "$out/gguf-kernels-sm120" || rc=1
  fi
  return $rc
}

ab_prepare() {   # here: each revision's tree as DIR/REV.tar
  mkdir -p "$dir"
  local rev
  for rev in "$@"; do
    git -C "$here" archive --format=tar -o "$(cd "$dir" && pwd)/$rev.tar" "$rev" || return 1
  done
  ls -l "$dir"/*.tar
}

gguf_wheel() {   # the gguf wheel in DIR, as an absolute path; $1 names the caller in the error
  local w
  w=$(ls "$dir"/gguf-*.whl 2>/dev/null | head -1)
  [ -n "$w" ] || { echo "$1: no gguf wheel in $dir (bench/device_gguf.sh prepare $dir)" >&2; return 1; }
  echo "$(cd "$(dirname "$w")" && pwd)/$(basename "$w")"
}

run_path() {   # the PYTHONPATH that runs tree $1 without installing it: bench by its installed name (a link
  # under $2) and the gguf wheel $3 (a pure-Python wheel imports from its zip)
  mkdir -p "$2" && ln -sfn "$1/bench" "$2/fastcomm_bench"
  echo "$1:$1/integrations/vllm:$2:$3"
}

ab() {   # on the device: GPU tests on the first tree, the kernel table on each; trees run from /tmp, not installed
  local out=${OUT:-$here/out} first=1 rev d rc=0 wheel
  mkdir -p "$out"
  wheel=$(gguf_wheel ab) || return 1
  for rev in "$@"; do
    d=/tmp/fc-ab/$rev
    rm -rf "$d" && mkdir -p "$d" && tar -xf "$dir/$rev.tar" -C "$d" || return 1
    (
      cd "$d" || exit 1
      # the kernel cache keys on the source, so trees can share it
      PYTHONPATH=$(run_path "$d" "$d/.pp" "$wheel") && export PYTHONPATH FASTCOMM_CACHE_DIR=/tmp/fc-ab-cache
      # A failed test does not stop the table (device time is scarce); the call's status does.
      t=0
      if [ "$first" = 1 ] && [ -n "${AB_TESTS:-}" ]; then kernel_tests "$out/tests-$rev.log" || t=1; fi
      kernel_table "${AB_TOKENS:-1,4,8}" "$out/kernels-$rev${AB_TAG:-}" > /dev/null || exit 1
      grep "^# per decode step" "$out/kernels-$rev${AB_TAG:-}.txt" | sed "s/^/$rev${AB_TAG:-} /"
      exit "$t"
    ) || { echo "== ab: $rev failed (see $out/*-$rev.*)"; rc=1; }
    first=0
  done
  return $rc
}

profile_ncu() {   # on the device: ncu on single products (NCU_OPS: op:form:kernel-regex;...), sections per kernel
  local out=${OUT:-$here/out} tool wheel spec op form kernels rc=0
  tool=$(command -v ncu || echo "$(cuda_home)/bin/ncu")
  [ -x "$tool" ] || { echo "ncu: no ncu on PATH or in $(cuda_home)/bin" >&2; return 1; }
  wheel=$(gguf_wheel ncu) || return 1
  mkdir -p "$out"
  PYTHONPATH=$(run_path "$here" /tmp/fc-ncu-pp "$wheel") && export PYTHONPATH
  export FASTCOMM_CACHE_DIR=${FASTCOMM_CACHE_DIR:-/tmp/fastcomm-cache}
  IFS=';' read -ra specs <<< "${NCU_OPS:-moe:grouped:fc_kq_moe_mma;o_proj:mma:fc_kq_mma_}"
  for spec in "${specs[@]}"; do
    IFS=: read -r op form kernels <<< "$spec"
    python -m fastcomm_bench.kquant_profile --op "$op" --tokens "${NCU_TOKENS:-8}" --form "$form" --calls 1 \
      > /dev/null || { rc=1; continue; }  # compiles the kernels outside the profile
    # --clock-control none: the device notes ask to leave the clocks alone; the first call's launches skipped
    timeout 280 "$tool" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section InstructionStats --section Occupancy \
      --section LaunchStats --section SourceCounters --kernel-name "regex:$kernels" --launch-skip 2 \
      --launch-count 2 python -m fastcomm_bench.kquant_profile --op "$op" --tokens "${NCU_TOKENS:-8}" \
      --form "$form" --calls 3 > "$out/ncu-${op// /_}-${form}.txt" 2>&1 || rc=1
    grep -E "^  [a-z_0-9]+ \(|Duration|DRAM Throughput|L1/TEX Cache Throughput|Issued Warp|Registers Per" \
      "$out/ncu-${op// /_}-${form}.txt" | head -n 40
  done
  return $rc
}

serve() {
  local out=${OUT:-$here/out}
  mkdir -p "$out/serve"
  exec > >(tee "$out/serve/device_gguf.log") 2>&1
  install || return 1
  local dep missing=()
  for dep in "${SERVE_DEPS[@]}"; do
    python -c "import ${dep%%=*}" 2>/dev/null || missing+=("${dep#*=}")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "== for vllm serve: ${missing[*]}"
    python -m pip install -q --no-index --no-deps --find-links "$dir/serve-wheels" "${missing[@]}" || return 1
  fi
  # What the server imports when it starts and builds its routes: a module still missing is named here.
  python -c "import vllm.entrypoints.openai.api_server, vllm.entrypoints.serve.instrumentator.metrics" \
    || echo "== vllm serve cannot import all it needs (above); the check will fail at server start"
  # The console script and the entry points (fastcomm, fastcomm_gguf) come from `pip install -e .` above.
  echo "== fastcomm-serve: $(command -v fastcomm-serve || echo 'not on PATH (the check falls back to python -m)')"
  # shellcheck disable=SC2086  # SERVE_GPU_ARGS is a list of options
  timeout 540 python tests/gguf/serve_gpu.py "$out/serve" ${SERVE_GPU_ARGS:-}
  local rc=$?
  rm -rf "$out/serve/model" "$out/serve/cache"   # the tiny model and its derived folder: regenerated from the seed
  echo "== serve check exit $rc; results: $out/serve/serve_gpu.json"
  return $rc
}

tp_one_gpu() {  # TP 1-8 with every rank on this one GPU (tests/gguf/tp_one_gpu.py; TP_PARTS picks the engines)
  local out=${OUT:-$here/out}/tp
  mkdir -p "$out"
  install || return 1
  # Outside $OUT: the kernels' NVRTC cache lives on while the machine does.
  export FASTCOMM_CACHE_DIR=${FASTCOMM_CACHE_DIR:-/tmp/fastcomm-cache}
  timeout "${TP_BUDGET_S:-570}" python tests/gguf/tp_one_gpu.py "$out" "${TP_PARTS:-ref,tp1,tp2}"
  python tests/gguf/tp_one_gpu.py --report "$out" > "$out/report.json"
  local rc=$?
  rm -rf "$out/models"
  # One archive of the engines' JSONs and logs beside report.json: the device's fetch brings back few files.
  (cd "$out" && tar czf engines.tgz --exclude=report.json *.json *.log 2>/dev/null \
     && find . -maxdepth 1 \( -name '*.json' -o -name '*.log' \) ! -name report.json -delete)
  tail -60 "$out/report.json"
  return $rc
}

case "$mode" in
  prepare) prepare ;;
  install) install ;;
  tp) tp_one_gpu ;;
  shard) shard "${3:-}" ;;
  run) run ;;
  serve) serve ;;
  kquant) kquant ;;
  model) model ;;
  figures) figures "${3:-}" ;;
  ab-prepare) ab_prepare "${@:3}" ;;
  ab) ab "${@:3}" ;;
  ncu) profile_ncu ;;
  *) echo "usage: device_gguf.sh prepare|install|run|kquant|model|figures|serve DIR [gguf|mtp|fp8|fp8-spread|gguf-profile|fp8-profile]" >&2
     echo "       device_gguf.sh ab-prepare|ab DIR REV...; device_gguf.sh ncu DIR" >&2; exit 2 ;;
esac
