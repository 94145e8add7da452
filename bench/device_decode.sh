#!/usr/bin/env bash
# One device call for the end-to-end decode benchmark (vLLM staged as ../shared/tools/VLLM_ON_DEVICE.md says).
#   bash bench/device_decode.sh TAG MODEL CONFIGS [more fastcomm bench-decode arguments]
# MODEL is anything bench-decode's --model takes: a shipped config (glm5-78L-16E, glm5-mini, glm5-mini-mtp),
# a config or checkpoint directory, a GGUF file.
# One bench-decode process per backend, so a call cut short at its time limit still brings back every backend
# that finished. Under $OUT: decode-TAG-BACKEND.json (the row), profile-TAG-BACKEND.json (where that
# backend's GPU time goes, with --profile-dir), and at the end report-TAG.txt (merged table and profile
# summary, GPU clocks per backend) and logs-TAG.tar.gz (the vLLM logs and clock samples).
set -uo pipefail
OUT=${OUT:-/tmp/fastcomm-out}
mkdir -p "$OUT"
tag=$1 model=$2 configs=$3
shift 3
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FASTCOMM_CACHE_DIR=/tmp/fastcomm-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install-$tag.log 2>&1 \
  || { cat /tmp/install-$tag.log; exit 1; }
# Kernels into the disk cache, so start-up times exclude NVRTC: the communication kernels where a fastcomm
# backend runs (~60 s on a fresh machine), the K-quant decode kernels for a GGUF model (~15 s).
case ",$configs," in *,fastcomm*) fastcomm compile --arch sm_90 >/dev/null 2>&1 ;; esac
case "$model" in *.gguf) python3 -c 'import sys; from pathlib import Path; from fastcomm.runtime import jit
jit.cached_cubin("sm_90", Path(sys.argv[1]), unit="kquant")' "$FASTCOMM_CACHE_DIR" >/dev/null 2>&1 ;; esac
query=$(python3 -c 'from fastcomm_bench.clocks import QUERY; print(QUERY)')  # the format clocks.py parses
prof=$(python3 -c 'import sys; a=sys.argv[1:]; print(a[a.index("--profile-dir")+1] if "--profile-dir" in a else "")' "$@")
work=/tmp/decode-$tag
mkdir -p "$work"
rc=0
for cfg in ${configs//,/ }; do
  # Clocks beside each backend (observed only): tells a clock or power state from a communicator effect.
  nvidia-smi --query-gpu="$query" --format=csv,noheader,nounits -lms 500 >"$work/clocks-$cfg.csv" 2>/dev/null &
  sampler=$!
  fastcomm bench-decode --model "$model" --configs "$cfg" --out "$work/$cfg.json" "$@" 2>&1 | tail -n 12
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  kill $sampler 2>/dev/null; wait $sampler 2>/dev/null
  cp "$work/$cfg.json" "$OUT/decode-$tag-$cfg.json" 2>/dev/null
  # One summary per profile folder: the backend's (1 request) and BACKEND-cN (--profile-concurrency N).
  # PROFILE_SUMMARY_ARGS: e.g. the weight-read floor's --weight-bytes / --copy-gbps (device_gguf.sh shard);
  # PROFILE_SUMMARY_ARGS_CN for the profile at N requests (whose step reads more experts).
  for d in ${prof:+"$prof/$cfg" "$prof/$cfg"-c[0-9]*}; do
    [ -d "$d" ] || continue
    name=$(basename "$d") n=${d##*-c}
    args_var=PROFILE_SUMMARY_ARGS
    [ "$name" != "$cfg" ] && args_var=PROFILE_SUMMARY_ARGS_C$n
    python3 -m fastcomm_bench.profile_summary "$prof" --backend "$name" --json "$OUT/profile-$tag-$name.json" \
      ${!args_var:-} >"$OUT/profile-$tag-$name.txt"
  done
done
{
  fastcomm bench-decode --compare "$work"/*.json
  ls "$OUT"/profile-"$tag"-*.json >/dev/null 2>&1 && python3 -m fastcomm_bench.profile_summary --print "$OUT"/profile-"$tag"-*.json
  # Where a step of N requests (a verify step of N - 1 drafts) spends beyond one request's, per backend.
  for f in "$OUT"/profile-"$tag"-*-c[0-9]*.json; do
    [ -f "$f" ] || continue
    b="${f%-c[0-9]*.json}.json"
    [ -f "$b" ] && { echo "# $(basename "$f" .json) beyond $(basename "$b" .json)"; python3 -m fastcomm_bench.profile_summary --diff "$b" "$f"; }
  done
  echo "# GPU clocks while each backend ran (samples at >= 50 % utilization)"
  python3 -m fastcomm_bench.clocks "$work"/clocks-*.csv
} >"$OUT/report-$tag.txt" 2>&1
cat "$OUT/report-$tag.txt"
tar czf "$OUT/logs-$tag.tar.gz" -C "$work" . 2>/dev/null
exit $rc
