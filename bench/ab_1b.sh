#!/bin/bash
# Issue 17, one device call: this tree's shardtune against an earlier commit's on table 1's 1B run (seq 2048,
# micro-batch 4, bf16, compiled blocks, model.liger=loss, the one-GPU defaults), each logged every step (as
# calls 42-46) and every 10 steps (as a user's run logs), with HF Trainer + DeepSpeed ZeRO-2 (+ Liger) in the
# same call.
#
#   host, first:  rm -rf .ab_src && mkdir .ab_src && git archive COMMIT src | tar -x -C .ab_src
#   run tool: kind nvidia-h200, carry [".whl", ".anchors", ".ab_src"], timeout_s 600, command: bash bench/ab_1b.sh
#
# Knobs: RUNS (default "old:1 new:1 new:10": TREE:LOG_EVERY, TREE old = .ab_src/src, new = ./src), BASELINES
# (default "hft_ds2 hft_ds2_liger"), VARIANT (default zero2c_lgl_dir; core.sh runs FSDP2 unless the variant ends _dir), STEPS1 (45) / STEPS10 (160) steps of a run
# logged every step / every 10, WARMUP (10), BUDGET (seconds for all, default 550).
# CPU dry run: OUT=/tmp/ab SIZE=tiny SKIP_INSTALL=1 BASELINES= VARIANT=zero2 bash bench/ab_1b.sh
# Writes $OUT/table.md (all rows, ratios against the call's baselines: bench/combine.py), $OUT/results.jsonl and $OUT/raw.tgz (each core.sh run's files).
set -u
cd "$(dirname "$0")/.." || exit 1
O=${OUT:-/tmp/bench_out}
mkdir -p "$O"
export SIZE=${SIZE:-1b} NPROC=1 WARMUP=${WARMUP:-10} SPREAD=1 REF=hft_ds2 SECOND_REF=hft_ds2_liger
export BEXTRA="--steps ${STEPS1:-45} --warmup $WARMUP"
START=$SECONDS
BUDGET=${BUDGET:-550}
. bench/calls.sh
[ -n "${BASELINES-hft_ds2 hft_ds2_liger}" ] && \
  VARIANTS="" BASELINES=${BASELINES-hft_ds2 hft_ds2_liger} STEPS=${STEPS1:-45} EVERY=1 one baselines
for r in ${RUNS:-old:1 new:1 new:10}; do
  tree=${r%%:*} every=${r##*:}
  src=$PWD/src
  [ "$tree" = old ] && src=$PWD/.ab_src/src
  [ -d "$src/shardtune" ] || { echo "== $r: no tree at $src"; continue; }
  steps=${STEPS1:-45}
  [ "$every" != 1 ] && steps=${STEPS10:-160}
  VARIANTS=${VARIANT:-zero2c_lgl_dir} BASELINES="" SRC=$src STEPS=$steps EVERY=$every one "${tree}_e$every"
done
finish "1b full fine-tuning, seq 2048, micro-batch 4, bf16, 1 GPU; medians of the logged records after step $WARMUP" \
  "(a run tagged _e1 logs every step: ${STEPS1:-45} steps; _e10 every 10: ${STEPS10:-160} steps)"
