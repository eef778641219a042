#!/bin/bash
# Issue 17, tables 2-3: Llama-3-8B shape, LoRA / QLoRA r=16 on all projections, 1 H200, seq 2048,
# micro-batch 2, bf16, activation checkpointing; shardtune vs HF Trainer + PEFT (+ bitsandbytes for QLoRA)
# with and without Liger, in one device call. Host side first: `bash bench/prepare.sh` (keeps liger_kernel
# and bitsandbytes).
#
#   run tool: kind nvidia-h200, carry [".whl"], timeout_s 600, command: bash bench/table2.sh
#
# Knobs: RUNS and BASELINES (bench/peft_bench.py specs METHOD:NPROC[:c][:lg|:lgl][:sel][:sf][:dir][:ch]), STEPS (40), WARMUP (10),
# BUDGET (seconds for the whole script, 560), MBS (2), SIZE (8b), SRC (the src tree to import, default ./src), EXTRA (overrides for every shardtune run, e.g.
# EXTRA='log.memory_snapshot=[3,3]': each run's memory/rank0.txt is copied to $OUT/memory/, and profile/*.txt
# to $OUT/profile/).
# Writes $OUT/peft_results.jsonl, $OUT/peft_table.md and $OUT/peft_logs.txt (every run's log, long ones cut).
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ ! -d /tmp/site ] && ls .whl/*.whl >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "!! pip install of .whl failed"
fi
S=${SRC:-$PWD/src}  # the shardtune tree the runs import (an earlier commit's, unpacked into .ab_src: bench/ab_1b.sh)
echo "== shardtune from $S"
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$S || export PYTHONPATH=$S${PYTHONPATH:+:$PYTHONPATH}
# Defaults: table 2 as the README quotes it (compiled blocks, Liger's fused loss, the one-GPU defaults) against
# HF + PEFT + Liger and HF + PEFT; table 3: RUNS=qlora:1:c:lgl BASELINES=qlora:1:lg,qlora:1.
RUNS=${RUNS-lora:1:c:lgl} BASELINES=${BASELINES-lora:1:lg,lora:1}
W=/tmp/shardtune_peft
rm -rf "$W"
python3 bench/peft_bench.py --size "${SIZE:-8b}" --runs "$RUNS" --baselines "$BASELINES" --first baselines \
  --steps "${STEPS:-40}" --warmup "${WARMUP:-10}" --mbs "${MBS:-2}" --budget "${BUDGET:-560}" --timeout 240 \
  --out "$W" --extra "${EXTRA:-}" | tee "$OUT/peft_table.md"
cp "$W/peft_results.jsonl" "$OUT/" 2>/dev/null
for f in "$W"/st_*/memory/*.txt "$W"/st_*/profile/*.txt; do  # log.memory_snapshot / log.profile summaries
  [ -f "$f" ] || continue
  d=$(basename "$(dirname "$f")")
  mkdir -p "$OUT/$d"
  cp "$f" "$OUT/$d/$(basename "$(dirname "$(dirname "$f")")")_$(basename "$f")"
done
for f in "$W"/*.log; do
  [ -f "$f" ] || continue
  echo "=================== $(basename "$f")"
  if [ "$(wc -l < "$f")" -le 300 ]; then cat "$f"; else head -n 60 "$f"; echo "[... cut ...]"; tail -n 200 "$f"; fi
done > "$OUT/peft_logs.txt"
