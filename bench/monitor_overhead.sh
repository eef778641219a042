#!/bin/bash
# Issue 18: what the run's monitors cost. One shardtune variant (default zero2c_lgl, 1B shape, 1 GPU) run
# alternately with all monitors off and on (log.system: the NVML sampling thread; log.comm: the collective counter), so
# drift of the machine falls on both sides; each run is the median of its timed steps (bench/core.sh).
#
#   run tool: kind nvidia-h200, carry [".whl", ".anchors"], command: bash bench/monitor_overhead.sh
#
# Knobs: VARIANT, PAIRS (2: off on off on), BUDGET (seconds for all runs, 400). Writes $OUT/monitor_overhead.md.
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
V=${VARIANT:-zero2c_lgl}
START=$SECONDS
rows=()
for i in $(seq 1 "${PAIRS:-2}"); do
  for sys in false true; do
    left=$(( ${BUDGET:-400} - (SECONDS - START) ))
    [ "$left" -gt 60 ] || { echo "budget spent"; break 2; }
    o="$OUT/monitor_${sys}_$i"
    OUT=$o VARIANTS=$V BASELINES= REF=none SECOND_REF= BUDGET=$left SPREAD=1 SIZE=${SIZE:-1b} STEPS=${STEPS:-45} \
      WARMUP=${WARMUP:-10} EVERY=1 EXTRA="log.system=$sys log.comm=$sys" bash bench/core.sh > "$o.log" 2>&1
    row=$(grep "^| $V " "$o/table.md" 2>/dev/null | head -1)
    echo "log.system=$sys run $i: $row"
    rows+=("| $sys | $i ${row#| $V }")
  done
done
{
  echo "monitor overhead: $V, alternating log.system=false/true"
  echo "| log.system | run | tokens/s/GPU | min-max | ratio | MFU | peak alloc GiB | peak reserved GiB | step time s |"
  echo "|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee "$OUT/monitor_overhead.md"
