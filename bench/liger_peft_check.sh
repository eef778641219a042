#!/bin/bash
# Diagnostic (device): shardtune LoRA + model.liger on the Llama-3.2-1B shape, a few steps each, with
# CUDA_LAUNCH_BLOCKING=1 so a bad kernel names itself. Varies what the 8B LoRA + Liger crash (illegal memory
# access in the checkpoint recompute, bench/RESULTS.md 2026-12-02) may depend on. Prints one line per case.
#   run tool: carry [".whl"], command: bash bench/liger_peft_check.sh
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/bench_out}; mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 CUDA_LAUNCH_BLOCKING=1
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src
W=/tmp/liger_check; rm -rf "$W"; mkdir -p "$W"
python3 bench/make_long_text.py "$W/long.jsonl" --n 64 --chars 1200 --min-tokens 1024 >/dev/null 2>&1
CASES=${CASES:-"true:full:zero3 loss:full:zero3 true:none:zero3 true:full:zero2"}
for c in $CASES; do
  IFS=: read -r lg ac strat <<< "$c"
  name="lora_${lg}_${ac}_${strat}"
  timeout -k 5 "${T:-60}" python3 -m shardtune train bench/bench.yaml --nproc 1 model.preset=llama-3.2-1b \
    data.train_file="$W/long.jsonl" data.eval_fraction=0 train.seq_len=1024 train.micro_batch_size=2 \
    train.precision=bf16 train.max_steps="${STEPS:-4}" log.every=1 log.progress=false checkpoint.save_final=false \
    checkpoint.at_end=false parallel.strategy="$strat" parallel.activation_checkpointing="$ac" peft.method=lora \
    peft.r=16 model.liger="$lg" train.output_dir="$W/$name" > "$W/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(grep -m1 -E 'Error|error:' "$W/$name.log" | cut -c1-200)"
  { echo "=================== $name rc=$rc"; grep -v "Backend impl" "$W/$name.log" | tail -n 60; } >> "$OUT/liger_check.txt"
done
