#!/bin/bash
# Issue 18: what the run's monitors cost. One shardtune variant (default zero2c_lgl, 1B shape, 1 GPU) run
# alternately with each monitor setting, so drift of the machine falls on every side; each run is the median of its
# timed steps (bench/core.sh).
#
#   run tool: kind nvidia-h200, carry [".whl", ".anchors"], command: bash bench/monitor_overhead.sh
#
# Knobs: VARIANT, PAIRS (rounds over the settings, 2), BUDGET (seconds for all runs, 400), SETTINGS: "name=overrides"
# separated by ";" (default: all off, then all on; log.system is the NVML sampling thread, log.comm the collective
# counter, log.tensorboard the event writer). Each monitor alone, e.g.:
#   SETTINGS="off=log.system=false log.comm=false;system=log.system=true log.comm=false;comm=log.system=false log.comm=true;tb=log.system=false log.comm=false log.tensorboard=true"
# Writes $OUT/monitor_overhead.md.
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
V=${VARIANT:-zero2c_lgl}
SETTINGS=${SETTINGS:-"off=log.system=false log.comm=false;on=log.system=true log.comm=true"}
IFS=';' read -r -a settings <<< "$SETTINGS"
START=$SECONDS
rows=()
for i in $(seq 1 "${PAIRS:-2}"); do
  for setting in "${settings[@]}"; do
    name=${setting%%=*}
    left=$(( ${BUDGET:-400} - (SECONDS - START) ))
    [ "$left" -gt 60 ] || { echo "budget spent"; break 2; }
    o="$OUT/monitor_${name}_$i"
    OUT=$o VARIANTS=$V BASELINES= REF=none SECOND_REF= BUDGET=$left SPREAD=1 SIZE=${SIZE:-1b} STEPS=${STEPS:-45} \
      WARMUP=${WARMUP:-10} EVERY=1 EXTRA="${setting#*=}" bash bench/core.sh > "$o.log" 2>&1
    row=$(grep "^| $V " "$o/table.md" 2>/dev/null | head -1)
    echo "$name run $i: $row"
    rows+=("| $name | $i ${row#| $V }")
  done
done
{
  echo "monitor overhead: $V, settings in turn: $SETTINGS"
  echo "| monitors | run | tokens/s/GPU | min-max | ratio | MFU | peak alloc GiB | peak reserved GiB | step time s |"
  echo "|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee "$OUT/monitor_overhead.md"
