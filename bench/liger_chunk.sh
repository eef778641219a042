#!/bin/bash
# Issue 17, one device call: Liger's fused loss at several `model.liger_chunk` sizes (tokens whose logits it
# makes at once; 0 = Liger's own, 256 at this shape), 1B full fine-tuning as bench/table1.sh (seq 2048,
# micro-batch 4, bf16, compiled blocks, model.liger=loss), on the one-GPU path without FSDP2 and with it, and
# the HF baselines of table 1 in the same call.
#
#   run tool: kind nvidia-h200, carry [".whl", ".anchors"], timeout_s 600, command: bash bench/liger_chunk.sh
#
# Knobs: CHUNKS (default "0 1024 2048 8192", on zero2c_lgl_dir), FSDP2_CHUNKS (default "1024", on zero2c_lgl),
# BASELINES (default "hft_ds2 hft_ds2_liger"), BUDGET (seconds for all, default 550); CPU dry run of the
# plumbing: OUT=/tmp/lc SIZE=tiny SKIP_INSTALL=1 BASELINES= DIR_VARIANT=zero2_dir FSDP2_VARIANT=zero2 bash bench/liger_chunk.sh
# Writes $OUT/table.md (all rows, ratios against the call's baselines: bench/combine.py), $OUT/results.jsonl and $OUT/raw.tgz (each core.sh run's files).
set -u
cd "$(dirname "$0")/.." || exit 1
O=${OUT:-/tmp/bench_out}
mkdir -p "$O"
export SIZE=${SIZE:-1b} NPROC=1 STEPS=${STEPS:-45} WARMUP=${WARMUP:-10} EVERY=1 SPREAD=1
export BEXTRA="--steps $STEPS --warmup $WARMUP" REF=hft_ds2 SECOND_REF=hft_ds2_liger
START=$SECONDS
BUDGET=${BUDGET:-550}
. bench/calls.sh
VARIANTS="" BASELINES=${BASELINES-hft_ds2 hft_ds2_liger} EXTRA="" one baselines
for c in ${CHUNKS-0 1024 2048 8192}; do
  VARIANTS=${DIR_VARIANT:-zero2c_lgl_dir} BASELINES="" EXTRA="model.liger_chunk=$c" one "dir_c$c"
done
for c in ${FSDP2_CHUNKS-1024}; do
  VARIANTS=${FSDP2_VARIANT:-zero2c_lgl} BASELINES="" EXTRA="model.liger_chunk=$c" one "fsdp2_c$c"
done
finish "1b full fine-tuning, seq 2048, micro-batch 4, bf16, 1 GPU; medians after step $WARMUP of $STEPS (log.every=1)"
