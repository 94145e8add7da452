#!/usr/bin/env bash
# One device call that installs, checks and times everything; results land under $OUT.
#   FASTCOMM_COMMIT=<sha> bash bench/device_run.sh [tests] [bench] [nop2p] [-- pytest selection...]
# GPU tests first (correctness before speed), then the P2P/host microbenchmark, then the NCCL_P2P_DISABLE=1
# run that stands in for GPUs without P2P. Each stage runs even if an earlier one failed, so one call
# brings back everything it can. With one GPU the GPU tests run every world size with ranks sharing it;
# the benchmarks need two GPUs (ratios against NCCL in the same run) and say so otherwise.
set -uo pipefail
OUT=${OUT:-/tmp/fastcomm-out}
mkdir -p "$OUT"
stages=() sel=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; sel=("$@"); break; fi
  stages+=("$1"); shift
done
[ ${#stages[@]} -gt 0 ] || stages=(tests bench nop2p)
commit=${FASTCOMM_COMMIT:-unknown}
# NVLink multicast stays off on shared hosts (see the device notes); fastcomm never uses it anyway.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FASTCOMM_CACHE_DIR=/tmp/fastcomm-cache
# Where vLLM was staged on this machine (../shared/tools/VLLM_ON_DEVICE.md), the bench gains its custom
# all-reduce row and the vLLM GPU test runs.
if [ -d /tmp/stage ] && [ -f .stage/install.sh ]; then eval "$(bash .stage/install.sh)"; fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
{
  echo "# commit $commit"; date -u; nvidia-smi -L; nvidia-smi topo -m
  python3 -c "import torch, cupy; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'cupy', cupy.__version__)"
} >"$OUT/env.txt" 2>&1
t0=$(date +%s)
fastcomm compile --arch sm_90 >>"$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt"; exit 1; }
echo "compile: $(( $(date +%s) - t0 )) s; $ngpu GPU(s)"
rc=0
if [[ " ${stages[*]} " == *" tests "* ]]; then
  gpu_dirs=(tests/gpu tests/gguf)  # the GGUF ones skip, each with its reason, without vLLM, the plugin or gguf
  [ "$ngpu" -ge 2 ] && python3 -c "import vllm" 2>/dev/null && gpu_dirs+=(tests/vllm)
  [ ${#sel[@]} -gt 0 ] && gpu_dirs=("${sel[@]}")
  { echo "# commit $commit; $ngpu GPU(s)"
    FASTCOMM_INSTAFAIL=1 timeout ${FASTCOMM_TEST_BUDGET_S:-540} python3 -m pytest -m gpu "${gpu_dirs[@]}" -q -s -rA -p no:cacheprovider 2>&1
  } | sed -e "s#$PWD/##g" -e "s#/tmp/[A-Za-z0-9._/-]*#<tmp>#g" | tee "$OUT/gpu_tests.log" \
    | grep -E "passed|failed|FAILED|Error|error|assert|record|P2P check|^E |^>" | tail -80
  rc=${PIPESTATUS[0]}
fi
if [ "$ngpu" -lt 2 ]; then
  echo "bench stages skipped: $ngpu GPU (ratios against NCCL need 2 GPUs in the same run)"
  exit $rc
fi
if [[ " ${stages[*]} " == *" bench "* ]]; then
  timeout 300 fastcomm bench --transports p2p,host --islands --fused --interleave -n 40 --json "$OUT/bench_p2p.json" \
    --label "commit $commit; 2xH200 NVLink, P2P + host transports" 2>&1 | tee "$OUT/bench_p2p.txt" | tail -80
fi
if [[ " ${stages[*]} " == *" nop2p "* ]]; then
  NCCL_P2P_DISABLE=1 timeout 200 fastcomm bench --transports host --no-symm --fused -e 4M -n 40 \
    --json "$OUT/bench_nop2p.json" --label "commit $commit; 2xH200, NCCL_P2P_DISABLE=1 vs fastcomm host transport" 2>&1 \
    | tee "$OUT/bench_nop2p.txt" | tail -40
fi
exit $rc
