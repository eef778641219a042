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
left() { echo $((BUDGET - (SECONDS - START))); }
one() {  # one core.sh run into $O/$1: VARIANTS BASELINES EXTRA from the environment
  local tag=$1 b
  b=$(left)
  [ "$b" -lt 60 ] && { echo "== $tag skipped: ${b}s left"; return; }
  OUT=$O/$tag BUDGET=$b bash bench/core.sh > "$O/$tag.log" 2>&1
  export SKIP_INSTALL=1  # installed once, by the first run, into /tmp/site
  [ -d /tmp/site ] && case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH};; esac
  TAGS="$TAGS $tag"
}
TAGS=""
VARIANTS="" BASELINES=${BASELINES-hft_ds2 hft_ds2_liger} EXTRA="" one baselines
for c in ${CHUNKS-0 1024 2048 8192}; do
  VARIANTS=${DIR_VARIANT:-zero2c_lgl_dir} BASELINES="" EXTRA="model.liger_chunk=$c" one "dir_c$c"
done
for c in ${FSDP2_CHUNKS-1024}; do
  VARIANTS=${FSDP2_VARIANT:-zero2c_lgl} BASELINES="" EXTRA="model.liger_chunk=$c" one "fsdp2_c$c"
done
{
  echo "1b full fine-tuning, seq 2048, micro-batch 4, bf16, 1 GPU; medians after step $WARMUP of $STEPS (log.every=1)"
  echo
  # shellcheck disable=SC2086
  python3 bench/combine.py "$O" $TAGS --results "$O/results.jsonl"
} > "$O/table.md"
tar czf "$O/raw.tgz" -C "$O" --exclude=raw.tgz --exclude=table.md --exclude=results.jsonl . 2>/dev/null
find "$O" -mindepth 1 -maxdepth 1 ! -name table.md ! -name raw.tgz ! -name results.jsonl -exec rm -rf {} +
cat "$O/table.md"
