#!/bin/bash
# Throughput benchmark: shardtune variants vs the HF Trainer + DeepSpeed ZeRO-2 baseline, one call.
#
# Device (from the repo root, carry [".whl", ".anchors"], kind nvidia-h200-x2):
#     bash bench/core.sh
# CPU dry run of the plumbing (here):
#     OUT=/tmp/benchout SIZE=tiny SKIP_INSTALL=1 bash bench/core.sh
#
# Knobs (environment):
#   OUT        folder for what comes back (default /tmp/bench_out; on the device $OUT is set)
#   SIZE       1b (llama-3.2-1b, mbs 4) | 8b (llama-3-8b, mbs 2) | tiny (tiny-llama, CPU-sized)
#   VARIANTS   shardtune runs, each (ddp|zero1|zero2|zero3)[c][_ac][_ds][_oo|_op]: c = parallel.compile=true,
#              _ac = activation checkpointing, _ds = parallel.backend=deepspeed, _oo / _op = DeepSpeed
#              offload of optimizer states / of parameters too. Default "zero2 zero3 zero2c zero3c" (CPU: "zero2 zero3")
#              _lg = model.liger=true (Liger-Kernel; needs liger-kernel in .whl), e.g. zero2c_lg;
#              _lgl = model.liger=loss (Liger's fused linear + cross-entropy only), e.g. zero2c_lgl;
#              _dir = parallel.one_gpu=direct (one process without FSDP2), last, e.g. zero2c_lgl_dir
#   BASELINES  hf_baseline.py modes: hf_ds2 hf_ds3 hf_fsdp fsdp2 fsdp2c hf_mismatch; or hft_ds2, hft_ds3,
#              hft_ds2_liger, hft_ds3_liger: bench/hf_trainer_baseline.py --mode full (+ HF_LIGER=1), which
#              reports the min-max of its timed steps too.
#              Default "hf_ds2 fsdp2c" on GPU, none on CPU. REF (default hf_ds2) runs first.
#   STEPS      shardtune train.max_steps (default 40; tiny 12)   WARMUP  records with step <= this are
#              left out of the medians (default 10; tiny 4)      EVERY   log.every (default 5; tiny 2)
#   MBS SEQ PREC NPROC   override micro-batch, seq_len, precision, process count
#   T          per-run timeout in seconds (default 150; 8b 300)
#   BUDGET     seconds for the whole script (default 560; the device allows 600 per command); a run
#              gets min(T, what is left), and is skipped when fewer than MIN_T (default 45) remain
#   EXTRA      extra shardtune overrides for every variant, shell-quoted, e.g. "optim.fused=false" or
#              "'log.profile={start: 20, steps: 2}'" (a value with spaces in its own quotes)
#   BEXTRA     extra hf_baseline.py arguments, e.g. "--steps 30"
#   SECOND_REF a second ratio column (summarize.py --second-ref; default fsdp2c)   SPREAD=1  a min-max column
#   SRC        the shardtune source tree the runs import (default ./src); e.g. an earlier commit's, unpacked
#              by bench/ab_1b.sh, to compare two versions in one call
#   SKIP_INSTALL=1  do not pip-install .whl (automatic when there is no GPU or no .whl/*.whl)
# Writes $OUT/{env.txt,logs.txt,results.jsonl,metrics.jsonl,table.md} (the device returns at most 8 files), and
# VARIANT_profile_rankR.txt / VARIANT_memory_rankR.txt where EXTRA asks for log.profile / log.memory_snapshot.
set -u   # no -e: a failing run is recorded and the benchmark goes on

cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
START=$SECONDS
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
: > "$OUT/logs.txt"
BUDGET=${BUDGET:-560}
MIN_T=${MIN_T:-45}
RESERVE=${RESERVE:-15}   # seconds kept back for the summary

# ---- (a) environment ---------------------------------------------------------------------------
HAVE_GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then HAVE_GPU=1; fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Keep NVLink multicast off, as the machine sets it (these only fill in what is unset).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
  NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}

INSTALLED=0
if [ "${SKIP_INSTALL:-0}" != 1 ] && [ "$HAVE_GPU" = 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  echo "== pip install .whl ($(ls .whl/*.whl | wc -l) wheels)"
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
    INSTALLED=1
  else
    echo "!! pip install of .whl failed; going on without it (pydantic/deepspeed may be missing)"
  fi
else
  echo "== skipping pip install (SKIP_INSTALL=${SKIP_INSTALL:-0}, gpu=$HAVE_GPU, wheels=$(ls .whl/*.whl 2>/dev/null | wc -l))"
fi
SRC=${SRC:-$ROOT/src}
if [ "$INSTALLED" = 1 ]; then
  export PYTHONPATH=/tmp/site:$SRC
else
  export PYTHONPATH=$SRC${PYTHONPATH:+:$PYTHONPATH}
fi

{
  GITREV=$(git rev-parse --short HEAD 2>/dev/null) && { git diff --quiet HEAD 2>/dev/null || GITREV="$GITREV+dirty"; }
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  git: ${GITREV:-none}"
  if [ "$HAVE_GPU" = 1 ]; then nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; else echo "no GPU"; fi
  python3 - <<'PY'
import sys, importlib.metadata as md
print("python", sys.version.split()[0])
for p in ("torch", "transformers", "accelerate", "deepspeed", "pydantic", "pydantic-core", "triton", "tokenizers"):
    try:
        print(f"{p} {md.version(p)}")
    except md.PackageNotFoundError:
        print(f"{p} MISSING")
try:
    import shardtune, shardtune.config  # noqa: F401  (needs pydantic)
    print("shardtune from", shardtune.__file__)
except Exception as err:
    print("shardtune NOT importable:", err)
PY
  env | grep -E '^(NCCL_|TORCH_NCCL|TORCH_SYMM|NVSHMEM_|CUDA_VISIBLE)' | sort
} 2>&1 | tee "$OUT/env.txt"

if [ "$HAVE_GPU" = 1 ]; then
  N=${NPROC:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
else
  N=${NPROC:-2}
fi

# ---- sizes -------------------------------------------------------------------------------------
SIZE=${SIZE:-1b}
case "$SIZE" in
  1b)   PRESET=llama-3.2-1b; BSIZE=1b;   D_SEQ=2048; D_MBS=4; D_STEPS=40; D_EVERY=5; D_WARMUP=10; D_PREC=bf16; D_T=150 ;;
  8b)   PRESET=llama-3-8b;   BSIZE=8b;   D_SEQ=2048; D_MBS=2; D_STEPS=40; D_EVERY=5; D_WARMUP=10; D_PREC=bf16; D_T=300 ;;
  tiny) PRESET=tiny-llama;   BSIZE=tiny; D_SEQ=64;   D_MBS=2; D_STEPS=12; D_EVERY=2; D_WARMUP=4;  D_PREC=fp32; D_T=120 ;;
  *) echo "SIZE=$SIZE: use 1b, 8b or tiny" >&2; exit 2 ;;
esac
SEQ=${SEQ:-$D_SEQ}; MBS=${MBS:-$D_MBS}; STEPS=${STEPS:-$D_STEPS}; EVERY=${EVERY:-$D_EVERY}
WARMUP=${WARMUP:-$D_WARMUP}; PREC=${PREC:-$D_PREC}; T=${T:-$D_T}
if [ "$HAVE_GPU" = 1 ]; then
  VARIANTS=${VARIANTS-zero2 zero3 zero2c zero3c}; BASELINES=${BASELINES-hf_ds2 fsdp2c}
else
  VARIANTS=${VARIANTS-zero2 zero3}; BASELINES=${BASELINES-}
fi
REF=${REF:-hf_ds2}
EXTRA=${EXTRA:-}; BEXTRA=${BEXTRA:-}

W=/tmp/shardtune_bench/$SIZE
rm -rf "$W"; mkdir -p "$W"
MAN=$W/runs.tsv; : > "$MAN"
echo "== SIZE=$SIZE preset=$PRESET world=$N seq=$SEQ mbs=$MBS prec=$PREC steps=$STEPS every=$EVERY warmup=$WARMUP T=$T budget=${BUDGET}s"
echo "== VARIANTS='$VARIANTS' BASELINES='$BASELINES' ref=$REF"

# ---- (b) data ----------------------------------------------------------------------------------
LINES=${LINES:-512}
python3 bench/make_long_text.py "$W/long.jsonl" --n "$LINES" --chars $((SEQ + SEQ / 8 + 32)) --seed 0 \
  --min-tokens "$SEQ" 2>&1 | grep -v 'Token indices sequence length' || echo "!! make_long_text failed"

# ---- runner ------------------------------------------------------------------------------------
append_log() {  # name rc seconds command: add the run's log to $OUT/logs.txt (long logs: head + tail)
  local log=$W/$1.log n
  n=$(wc -l < "$log" 2>/dev/null || echo 0)
  {
    echo; echo "=================== $1  rc=$2  ${3}s  ($n lines)"; echo "\$ $4"
    if [ "$n" -le 400 ]; then cat "$log"; else head -n 80 "$log"; echo "[... $((n - 380)) lines cut ...]"; tail -n 300 "$log"; fi
  } >> "$OUT/logs.txt" 2>/dev/null
}

run_one() {  # name kind metrics_path cmd...
  local name=$1 kind=$2 metrics=$3; shift 3
  local left=$((BUDGET - (SECONDS - START) - RESERVE)) t=$T t0 rc
  [ "$left" -lt "$t" ] && t=$left
  if [ "$t" -lt "$MIN_T" ]; then
    echo "== $name: SKIPPED (only ${left}s of the ${BUDGET}s budget left)"
    printf '%s\tskipped\t\t\t\t\n' "$name" >> "$MAN"
    echo "=================== $name  skipped (budget)" >> "$OUT/logs.txt"
    return
  fi
  echo "== $name (timeout ${t}s, t+$((SECONDS - START))s)"  # the full command is in logs.txt
  t0=$SECONDS
  timeout -k 10 "$t" "$@" > "$W/$name.log" 2>&1
  rc=$?
  local dt=$((SECONDS - t0))
  echo "   rc=$rc in ${dt}s"
  if [ "$kind" = baseline ]; then grep -h '^RESULT' "$W/$name.log" | tail -1; fi
  if [ "$rc" != 0 ]; then tail -n 5 "$W/$name.log" | sed 's/^/   | /'; sleep 3; fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$kind" "$rc" "$dt" "$W/$name.log" "$metrics" >> "$MAN"
  append_log "$name" "$rc" "$dt" "$*"
}

run_variant() {
  local v=$1 strat comp=false ac=none backend=fsdp2 offload=none liger=false one_gpu=fsdp2
  if [[ "$v" =~ ^(ddp|zero1|zero2|zero3)(c?)(_ac)?(_ds)?(_oo|_op)?(_lgl|_lg)?(_dir)?$ ]]; then
    strat=${BASH_REMATCH[1]}
    [ -n "${BASH_REMATCH[2]}" ] && comp=true
    [ -n "${BASH_REMATCH[3]}" ] && ac=full
    [ -n "${BASH_REMATCH[4]}" ] && backend=deepspeed
    [ "${BASH_REMATCH[5]}" = _oo ] && offload=optimizer
    [ "${BASH_REMATCH[5]}" = _op ] && offload=params
    [ "${BASH_REMATCH[6]}" = _lg ] && liger=true
    [ "${BASH_REMATCH[6]}" = _lgl ] && liger=loss
    [ -n "${BASH_REMATCH[7]}" ] && one_gpu=direct
  else
    echo "== $v: unknown variant (use ddp, zero1, zero2, zero3 + optional c, _ac, _ds, _oo|_op, _lg: zero3_ds_oo)"
    echo "unknown variant $v" > "$W/$v.log"
    printf '%s\tshardtune\t2\t0\t%s\t\n' "$v" "$W/$v.log" >> "$MAN"
    return
  fi
  rm -rf "${W:?}/$v"
  local extra=()
  eval "extra=($EXTRA)"  # shell quoting, so one override may hold spaces (a YAML flow mapping)
  run_one "$v" shardtune "$W/$v/metrics.jsonl" \
    python3 -m shardtune train bench/bench.yaml --nproc "$N" \
      model.preset="$PRESET" data.train_file="$W/long.jsonl" data.eval_fraction=0 \
      parallel.strategy="$strat" parallel.compile="$comp" parallel.activation_checkpointing="$ac" \
      parallel.backend="$backend" parallel.offload="$offload" model.liger="$liger" parallel.one_gpu="$one_gpu" \
      train.precision="$PREC" train.seq_len="$SEQ" train.micro_batch_size="$MBS" train.grad_accum=1 \
      train.max_steps="$STEPS" train.output_dir="$W/$v" \
      log.every="$EVERY" log.progress=false log.jsonl=true checkpoint.save_final=false "${extra[@]}"
  local rc=$?
  for f in "$W/$v"/profile/*.txt "$W/$v"/memory/*.txt; do  # log.profile / log.memory_snapshot summaries
    [ -f "$f" ] && cp "$f" "$OUT/${v}_$(basename "$(dirname "$f")")_$(basename "$f")"
  done
  return $rc
}

run_baseline() {
  local m=$1
  if [[ "$m" =~ ^hft_ds([23])(_liger)?$ ]]; then
    # bench/hf_trainer_baseline.py: HF Trainer + DeepSpeed ZeRO-2/3 (the config hf_baseline.py uses), full
    # fine-tuning, no activation checkpointing; reports min-max over its timed steps. _liger: HF_LIGER=1
    # (TrainingArguments(use_liger_kernel=True)).
    local stage=${BASH_REMATCH[1]} lg=0
    [ -n "${BASH_REMATCH[2]}" ] && lg=1
    printf '{"zero_optimization": {"stage": %s}, "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}\n' \
      "$stage" > "$W/ds$stage.json"
    # shellcheck disable=SC2086
    run_one "$m" baseline "" env HF_LIGER=$lg \
      python3 -m torch.distributed.run --standalone --nproc_per_node="$N" bench/hf_trainer_baseline.py \
        --mode full --size "$BSIZE" --seq "$SEQ" --mbs "$MBS" --no-ac --deepspeed "$W/ds$stage.json" $BEXTRA
    return
  fi
  if [ ! -f .anchors/hf_baseline.py ]; then
    echo "== $m: .anchors/hf_baseline.py is missing (carry .anchors)"
    echo ".anchors/hf_baseline.py missing" > "$W/$m.log"
    printf '%s\tbaseline\t2\t0\t%s\t\n' "$m" "$W/$m.log" >> "$MAN"
    return
  fi
  # shellcheck disable=SC2086
  run_one "$m" baseline "" \
    python3 -m torch.distributed.run --standalone --nproc_per_node="$N" .anchors/hf_baseline.py \
      --mode "$m" --size "$BSIZE" --seq "$SEQ" --mbs "$MBS" $BEXTRA
}

# ---- (c, d) runs: the reference first, then shardtune, then the other baselines -------------------
for m in $BASELINES; do [ "$m" = "$REF" ] && run_baseline "$m"; done
for v in $VARIANTS; do run_variant "$v"; done
for m in $BASELINES; do [ "$m" != "$REF" ] && run_baseline "$m"; done

# ---- (e) summary: the table is printed last ------------------------------------------------------
echo
echo "== summary (t+$((SECONDS - START))s)"
GPU_NAME=$( [ "$HAVE_GPU" = 1 ] && nvidia-smi --query-gpu=name --format=csv,noheader | head -1 || echo cpu)
python3 bench/summarize.py --manifest "$MAN" --warmup "$WARMUP" --ref "$REF" ${SECOND_REF:+--second-ref "$SECOND_REF"} \
  ${SPREAD:+--spread} \
  --results "$OUT/results.jsonl" --metrics-out "$OUT/metrics.jsonl" --table "$OUT/table.md" \
  --title "$SIZE ($PRESET), ${N} x ${GPU_NAME}, seq $SEQ, micro-batch $MBS, $PREC; shardtune: median of logged records after step $WARMUP (log.every=$EVERY, $STEPS steps); baselines: hf_baseline.py RESULT (median step); total $((SECONDS - START))s" \
  || { echo "summarize failed"; cat "$MAN"; }
