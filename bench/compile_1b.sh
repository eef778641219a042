#!/bin/bash
# Issue 17, one device call: table 1's 1B run (seq 2048, micro-batch 4, bf16, compiled blocks, model.liger=loss,
# the one-GPU defaults, logging every 10 steps) with each torch.compile setting in VARIANTS, against HF Trainer +
# DeepSpeed ZeRO-2 (+ Liger) in the same call. Call 57's profile had the GPU idle ~4 ms a step in small launch
# gaps (bench/RESULTS.md, nineteenth session); CUDA graphs or the C++ wrapper would cut the host's time per kernel.
#
#   run tool: kind nvidia-h200, carry [".whl", ".anchors"], timeout_s 600, command: bash bench/compile_1b.sh
#
# Knobs: VARIANTS (NAME=OVERRIDES, ';'-separated; default: defaults, cpp_wrapper, reduce-overhead), BASELINES
# (default "hft_ds2 hft_ds2_liger"), VARIANT (core.sh variant, default zero2c_lgl_dir), STEPS (160, logged every
# 10), WARMUP (10), BUDGET (550), MIN_T (90: a row with less left is skipped).
# CPU dry run: OUT=/tmp/c1 SIZE=tiny SKIP_INSTALL=1 BASELINES= STEPS=20 VARIANT=zero2c_dir VARIANTS="default=;ro=parallel.compile_mode=max-autotune-no-cudagraphs" bash bench/compile_1b.sh
# Writes $OUT/table.md, $OUT/results.jsonl and $OUT/raw.tgz (bench/calls.sh's finish).
set -u
cd "$(dirname "$0")/.." || exit 1
O=${OUT:-/tmp/bench_out}
mkdir -p "$O"
export SIZE=${SIZE:-1b} NPROC=1 WARMUP=${WARMUP:-10} SPREAD=1 REF=hft_ds2 SECOND_REF=hft_ds2_liger
# A compiled 1B row needs ~50 s to load and compile before its first logged interval (call 85 started the
# compiled update's row with ~60 s left and got one interval): skip a row with less than this left.
export MIN_T=${MIN_T:-90}
START=$SECONDS
BUDGET=${BUDGET:-550}
. bench/calls.sh
[ -n "${BASELINES-hft_ds2 hft_ds2_liger}" ] && BEXTRA="--steps 45 --warmup $WARMUP" \
  VARIANTS="" BASELINES=${BASELINES-hft_ds2 hft_ds2_liger} STEPS=45 EVERY=1 one baselines
VS=${VARIANTS:-"default=;cpp_wrapper='parallel.compile_options={cpp_wrapper: true}';reduce_overhead=parallel.compile_mode=reduce-overhead"}
IFS=';' read -ra LIST <<< "$VS"
for v in "${LIST[@]}"; do
  VARIANTS=${VARIANT:-zero2c_lgl_dir} BASELINES="" EXTRA="${v#*=}" STEPS=${STEPS:-160} EVERY=10 one "${v%%=*}"
done
finish "1b full fine-tuning, seq 2048, micro-batch 4, bf16, 1 GPU, compile settings; medians after step $WARMUP" \
  "(baselines log every step over 45 steps; shardtune rows every 10 over ${STEPS:-160})"
