#!/bin/bash
# Issues 18 and 19 on two GPUs, one device call (kind nvidia-h200-x2, carry [".whl", ".anchors"]):
#   1. tests/gpu on both GPUs (ddp / zero2 / zero3 bf16, and the profiled steps' bus bandwidth);
#   2. two "nodes" on one host over NCCL: two `shardtune train --nnodes 2 --node-rank N --nproc 1` (one GPU each,
#      a c10d rendezvous on 127.0.0.1), zero3 and hsdp, fp32, against one node with both GPUs; the two-node zero3
#      checkpoint then resumes on one GPU;
#   3. the 1B shape (zero2 + compile + Liger's loss) on both GPUs with steps 21-22 profiled: the GPU's idle gaps and
#      the collectives' achieved bus bandwidth (profile table), comm bytes against the planner's;
#   4. the monitors' cost on both GPUs: bench/monitor_overhead.sh (log.system + log.comm off / on, alternating).
# Writes $OUT/summary.md (the tables, printed last), $OUT/raw.tgz (logs, profile tables, metrics) and a few more.
set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
START=$SECONDS
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machine's rule: keep set
if ls .whl/*.whl >/dev/null 2>&1 && command -v nvidia-smi >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$ROOT/src
else
  export PYTHONPATH=$ROOT/src
fi
W=/tmp/multi_gpu; rm -rf "$W"; mkdir -p "$W"
SUM=$OUT/summary.md; : > "$SUM"
left() { echo $(( ${BUDGET:-560} - (SECONDS - START) )); }
{ date -u +%FT%TZ; git rev-parse --short HEAD 2>/dev/null; nvidia-smi topo -m 2>&1 | head -8
  python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version())'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# ---- 1. GPU tests ------------------------------------------------------------------------------------------------
if [ "${TESTS:-1}" = 1 ]; then
  t=$SECONDS
  timeout "${TESTS_T:-200}" python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/gpu \
    -k "all_gpus or profiled or host_copy" > "$W/gpu_tests.txt" 2>&1
  echo "== tests/gpu: rc=$? in $((SECONDS - t)) s: $(tail -1 "$W/gpu_tests.txt")" | tee -a "$SUM"
fi

# ---- 2. two nodes on one host ------------------------------------------------------------------------------------
COMMON=(examples/tiny.yaml train.precision=fp32 train.max_steps=20 log.every=1 log.progress=false log.report=false
        train.eval_every=0 "data.cache_dir=$W/cache")
two_nodes() {  # name strategy extra...: both "nodes" at once, one GPU each
  local name=$1 strategy=$2 port=$((29500 + RANDOM % 2000)) n; shift 2
  for n in 0 1; do
    CUDA_VISIBLE_DEVICES=$n timeout 150 python3 -m shardtune train "${COMMON[@]}" "parallel.strategy=$strategy" "$@" \
      --nproc 1 --nnodes 2 --node-rank $n --rdzv-endpoint "127.0.0.1:$port" --rdzv-id "$name" \
      --output-dir "$W/$name" > "$W/${name}_node$n.log" 2>&1 &
  done
  wait
}
if [ "${NODES:-1}" = 1 ] && [ "$(left)" -gt 300 ]; then
  t=$SECONDS
  timeout 150 python3 -m shardtune train "${COMMON[@]}" parallel.strategy=zero3 --nproc 2 --output-dir "$W/one_node" \
    > "$W/one_node.log" 2>&1
  two_nodes two_zero3 zero3 checkpoint.every_steps=10
  two_nodes two_hsdp hsdp
  # the two-node checkpoint of step 10, resumed on one GPU, runs steps 11-20 again
  rm -rf "$W/two_zero3/checkpoints/step-00000020"
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m shardtune train "${COMMON[@]}" parallel.strategy=zero3 --nproc 1 \
    --output-dir "$W/resumed" --resume "$W/two_zero3/checkpoints/step-00000010" > "$W/resumed.log" 2>&1
  python3 - "$W" <<'PY' | tee -a "$SUM"
import json, sys
from pathlib import Path
w = Path(sys.argv[1])
def losses(run):
    try:
        rows = [json.loads(x) for x in (w / run / "metrics.jsonl").read_text().splitlines()]
    except OSError:
        return {}
    return {r["step"]: r["loss"] for r in rows if "loss" in r and not r.get("eval")}
ref = losses("one_node")
print("\ntwo nodes on one host (one GPU each, NCCL), tiny fp32, 20 steps, against one node with both GPUs (zero3):")
print("| run | steps | max abs loss diff vs one node | last loss |")
print("|---|---|---|---|")
for run in ("one_node", "two_zero3", "two_hsdp", "resumed"):
    got = losses(run)
    common = sorted(set(got) & set(ref))
    diff = max((abs(got[s] - ref[s]) for s in common), default=float("nan"))
    last = got[max(got)] if got else float("nan")
    print(f"| {run} | {len(got)} ({min(got, default='-')}-{max(got, default='-')}) | {diff:.2e} | {last:.5f} |")
PY
  echo "(nodes part: $((SECONDS - t)) s)" | tee -a "$SUM"
fi

# ---- 3. the 1B shape profiled on both GPUs ------------------------------------------------------------------------
if [ "${PROFILE:-1}" = 1 ] && [ "$(left)" -gt 200 ]; then
  OUT=$W/profile VARIANTS=zero2c_lgl BASELINES= REF=none SECOND_REF= SKIP_INSTALL=1 NPROC=2 SIZE=1b STEPS=30 \
    BUDGET=$(( $(left) - 150 )) SPREAD=1 EXTRA="log.every=10 'log.profile={start: 21, steps: 2}'" \
    bash bench/core.sh > "$W/profile.log" 2>&1
  { echo; echo "1B zero2c_lgl on 2 GPUs, steps 21-22 profiled:"; cat "$W/profile/table.md" 2>/dev/null
    for r in 0 1; do echo "-- rank $r"; sed -n '/^GPU idle/,$p' "$W/profile/zero2c_lgl_profile_rank$r.txt" 2>/dev/null; done
  } | tee -a "$SUM"
fi

# ---- 4. the monitors' cost -----------------------------------------------------------------------------------------
if [ "${MONITORS:-1}" = 1 ] && [ "$(left)" -gt 150 ]; then
  OUT=$W/monitors NPROC=2 SKIP_INSTALL=1 PAIRS=${PAIRS:-2} BUDGET=$(( $(left) - 20 )) STEPS=${M_STEPS:-40} \
    bash bench/monitor_overhead.sh > "$W/monitors.log" 2>&1
  { echo; cat "$W/monitors/monitor_overhead.md" 2>/dev/null; } | tee -a "$SUM"
fi

cp -r "$W"/*.log "$W"/gpu_tests.txt "$OUT/" 2>/dev/null
tar czf "$OUT/raw.tgz" -C "$W" --exclude='*.json' --exclude='checkpoints' --exclude='cache' --exclude='*.pickle' \
  --exclude='*.safetensors' --exclude='*.bin' . 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$OUT" --remove-files $(cd "$OUT" && ls *.log gpu_tests.txt 2>/dev/null) 2>/dev/null
echo "== done in $((SECONDS - START)) s"
cat "$SUM"
