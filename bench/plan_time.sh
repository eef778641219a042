#!/bin/bash
# How long `shardtune plan` takes on a GPU node, and whether its nvidia-smi detection agrees with torch's.
# Run on the GPU machine from the repo root, with the wheels in /tmp/site (bench/README.md):
#   PYTHONPATH=/tmp/site:$PWD/src bash bench/plan_time.sh
set -u
OUT=${OUT:-/tmp/plan_time}
mkdir -p "$OUT"
run() {  # label, then the command; prints "label seconds rc"
  local label=$1; shift
  local t0=$EPOCHREALTIME
  "$@" > "$OUT/$label.out" 2> "$OUT/$label.err"
  local rc=$?
  awk -v a="$t0" -v b="$EPOCHREALTIME" -v l="$label" -v r="$rc" 'BEGIN { printf "%-34s %6.2f s  rc=%s\n", l, b - a, r }'
}
nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.reserved,mig.mode.current --format=csv,noheader,nounits \
  | tee "$OUT/smi.csv"
{
for i in 1 2 3; do run "plan-local-8b-$i" python3 -m shardtune.cli plan examples/llama-8b-deepspeed-offload.yaml; done
for i in 1 2; do run "plan-h100x8-8b-$i" python3 -m shardtune.cli plan examples/llama-8b-deepspeed-offload.yaml \
  --gpu h100 --nproc 8; done
run plan-local-1b python3 -m shardtune.cli plan examples/llama-1b.yaml
run plan-local-1b-lora python3 -m shardtune.cli plan examples/llama-1b.yaml peft.method=lora
run validate-local-8b python3 -m shardtune.cli validate examples/llama-8b-deepspeed-offload.yaml
run import-torch-transformers python3 -c "import torch, transformers.models.llama.modeling_llama"
} | tee "$OUT/times.txt"
python3 - <<'PY' | tee "$OUT/detect.txt"
import sys
from shardtune.launch import local_gpus
smi = local_gpus()
print("nvidia-smi path:", smi, "torch imported:", "torch" in sys.modules)
import torch
from shardtune.launch import local_gpus
print("torch path:    ", local_gpus())
print("torch total_memory:", [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())])
PY
head -3 "$OUT/plan-local-8b-1.out"; grep -h "^pick\|^config\|^host" "$OUT"/plan-local-*.out
