#!/usr/bin/env bash
# One device call that installs, checks and times everything; results land under $OUT.
#   bash bench/device_run.sh [tests] [bench] [nop2p]     (default: all three)
# GPU tests first (correctness before speed), then the P2P/host microbenchmark, then the NCCL_P2P_DISABLE=1
# run that stands in for GPUs without P2P. Each stage runs even if an earlier one failed, so one call
# brings back everything it can.
set -uo pipefail
OUT=${OUT:-/tmp/fastcomm-out}
mkdir -p "$OUT"
stages=${*:-tests bench nop2p}
# NVLink multicast stays off on shared hosts (see the device notes); fastcomm never uses it anyway.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FASTCOMM_CACHE_DIR=/tmp/fastcomm-cache
# Where vLLM was staged on this machine (../shared/tools/VLLM_ON_DEVICE.md), the bench gains its custom
# all-reduce row.
if [ -d /tmp/stage ] && [ -f .stage/install.sh ]; then eval "$(bash .stage/install.sh)"; fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
{
  date -u; nvidia-smi -L; nvidia-smi topo -m
  python3 -c "import torch, cupy; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'cupy', cupy.__version__)"
} >"$OUT/env.txt" 2>&1
t0=$(date +%s)
fastcomm compile --arch sm_90 >>"$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt"; exit 1; }
echo "compile: $(( $(date +%s) - t0 )) s"
rc=0
if [[ " $stages " == *" tests "* ]]; then
  # The vLLM GPU test (plugin in vLLM's own TP group, graphs, the fused op against vLLM's unfused path) runs
  # only where vLLM is importable, i.e. after staging.
  gpu_dirs=tests/gpu
  python3 -c "import vllm" 2>/dev/null && gpu_dirs="tests/gpu tests/vllm"
  timeout 600 python3 -m pytest -m gpu $gpu_dirs -q -s -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error|error|assert" | tail -40
  rc=${PIPESTATUS[0]}
fi
if [[ " $stages " == *" bench "* ]]; then
  timeout 300 fastcomm bench --transports p2p,host --islands --fused --interleave -n 40 --json "$OUT/bench_p2p.json" \
    --label "2xH200 NVLink, P2P + host transports" 2>&1 | tee "$OUT/bench_p2p.txt" | tail -80
fi
if [[ " $stages " == *" nop2p "* ]]; then
  NCCL_P2P_DISABLE=1 timeout 200 fastcomm bench --transports host --no-symm --fused -e 4M -n 40 \
    --json "$OUT/bench_nop2p.json" --label "2xH200, NCCL_P2P_DISABLE=1 vs fastcomm host transport" 2>&1 \
    | tee "$OUT/bench_nop2p.txt" | tail -40
fi
exit $rc
