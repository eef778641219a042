#!/bin/bash
# Issue 17, table 1, in one device call: Llama-3.2-1B shape, full fine-tuning, 1 H200, seq 2048, micro-batch 4,
# bf16, no activation checkpointing. Host side first: `bash bench/prepare.sh` (keeps the liger_kernel wheel).
#
#   run tool: kind nvidia-h200, carry [".whl", ".anchors"], timeout_s 600, command: bash bench/table1.sh
#
# Runs, in this order (bench/core.sh; a run is skipped when the 560 s budget is nearly spent):
#   hft_ds2        HF Trainer + DeepSpeed ZeRO-2 (bench/hf_trainer_baseline.py --mode full --no-ac)  [ratio 1]
#   zero2c_dir     shardtune zero2 + torch.compile per block, one process without FSDP2, the plain loss
#   zero2c_lgl_dir the same with Liger's fused loss (model.liger=loss; 1,024-token chunks): the defaults, as
#                  examples/llama-1b.yaml runs with liger-kernel installed (model.liger: auto)
#   hft_ds2_liger  HF Trainer + DeepSpeed ZeRO-2 + use_liger_kernel=True (HF_LIGER=1)  [second ratio column]
# Each run trains 45 steps; the first 10 are left out; shardtune logs every step (log.every=1), so every row is
# the median of 35 per-step tokens/s with their min-max (the baselines time each step the same way).
# Targets (issue 17): >= 1.6x hft_ds2 and >= 1.35x hft_ds2_liger, peak alloc <= hft_ds2_liger's (float8:
# EXTRA=train.float8=tensorwise, or bench/compile_1b.sh's VARIANTS).
# Knobs: VARIANTS (e.g. add zero2c, FSDP2 on one process), BASELINES, STEPS, WARMUP, and everything core.sh reads.
set -u
cd "$(dirname "$0")/.." || exit 1
export SIZE=${SIZE:-1b} NPROC=${NPROC:-1} STEPS=${STEPS:-45} WARMUP=${WARMUP:-10} EVERY=${EVERY:-1}
export VARIANTS=${VARIANTS-zero2c_dir zero2c_lgl_dir} BASELINES=${BASELINES-hft_ds2 hft_ds2_liger}
export REF=${REF:-hft_ds2} SECOND_REF=${SECOND_REF:-hft_ds2_liger} SPREAD=1
export BEXTRA=${BEXTRA:---steps $STEPS --warmup $WARMUP}
exec bash bench/core.sh
