#!/bin/bash
# Issue 17, one device call: does less host time per kernel pay on 8B LoRA (table 2's settings: seq 2048,
# micro-batch 2, checkpointing, compiled blocks, model.liger=loss, one H200)? Call 57's profile of that step
# (bench/profile_2026-12-04_call57/) had the GPU idle 11% of it, mostly in launch gaps inside the compiled blocks.
# Runs HF + PEFT + Liger once, then shardtune with each setting in VARIANTS (NAME=OVERRIDES, ';'-separated list;
# default: the defaults (bf16), float8 (its base kept as float8 casts), float8 at micro-batch 4: the rows README quotes;
# CUDA graphs ran with the checkpoint inside the compiled blocks, the default, +0.3% on QLoRA in call 83; cpp_wrapper
# fails on torch 2.11).
#
#   run tool: kind nvidia-h200, carry [".whl", ".anchors"], timeout_s 600, command: bash bench/lora_compile.sh
#
# Knobs: VARIANTS, STEPS (42), WARMUP (10), BUDGET (seconds for all, 560), METHOD (lora; qlora works too). A
# variant named old* imports .ab_src/src (host first: rm -rf .ab_src && mkdir .ab_src && git archive COMMIT src |
# tar -x -C .ab_src; carry ".ab_src" too), e.g. VARIANTS="old=;new=" for this tree against an earlier commit; a
# variant NAME with a tree in .ab_src/NAME/src (git archive COMMIT src | tar -x -C .ab_src/NAME) imports that one.
# CPU dry run (the plumbing only: model.liger=loss is refused on CPU, so each row ends rc 2):
#   OUT=/tmp/lc SIZE=tiny STEPS=4 WARMUP=1 BASE= bash bench/lora_compile.sh
# Writes $OUT/table.md (every run's row; ratios against the call's HF row) and $OUT/logs.tgz.
set -u
cd "$(dirname "$0")/.." || exit 1
O=${OUT:-/tmp/bench_out}
mkdir -p "$O"
START=$SECONDS BUDGET=${BUDGET:-560} M=${METHOD:-lora}
VARIANTS=${VARIANTS:-"default=;f8=train.float8=tensorwise;f8_mb4=train.float8=tensorwise train.micro_batch_size=4"}
export STEPS=${STEPS:-42} WARMUP=${WARMUP:-10} SIZE=${SIZE:-8b}
run() {  # run TAG RUNS BASELINES EXTRA
  local left=$((BUDGET - (SECONDS - START)))
  [ "$left" -lt 90 ] && { echo "== $1 skipped: ${left}s left"; return; }
  # the host's load before each run (HF's step is host-paced: its median fell 7,805 -> 7,104 over calls 134-136 on
  # one warm machine while shardtune's held; a process left from an earlier call would show here)
  { echo "== before $1: $(cat /proc/loadavg)"; ps -eo pcpu,pid,etime,comm --sort=-pcpu | head -4; } >> "$O/host.txt"
  OUT=$O/$1 RUNS=$2 BASELINES=$3 EXTRA=$4 BUDGET=$left bash bench/table2.sh > "$O/$1.log" 2>&1
  grep '^{' "$O/$1.log" | sed "s/^{/{\"tag\": \"$1\", /" >> "$O/rows.jsonl"
}
[ -n "${BASE-$M:1:lg}" ] && run hf "" "${BASE-$M:1:lg}" ""
IFS=';' read -ra VS <<< "$VARIANTS"
for v in "${VS[@]}"; do
  name=${v%%=*} src=$PWD/src
  case $name in old*) src=$PWD/.ab_src/src;; esac  # an earlier commit's tree (host: git archive COMMIT src)
  [ -d "$PWD/.ab_src/$name/src" ] && src=$PWD/.ab_src/$name/src  # or one unpacked under the variant's name
  SRC=$src run "$name" "$M:1:c:lgl" "" "${v#*=}"
done
python3 - "$O/rows.jsonl" > "$O/table.md" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
hf = next((r["tokens_per_s_per_gpu"] for r in rows if r.get("who") == "hf_peft" and r.get("rc") == 0), None)
print("| run | rc | tokens/s (min-max) | vs HF + PEFT + Liger | peak alloc GiB | timed steps' GiB | reserved GiB | "
      "power W | SM MHz | mJ/token |\n|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    t = r.get("tokens_per_s_per_gpu") or 0
    ratio = f"{t / hf:.2f}" if hf and t else "-"
    # the timed steps' median GPU power and SM clock (log.system's samples; the HF rows' from its sampler, where
    # NVML answers): energy per token at that power
    def median(key):
        values = sorted(s[key][0] for s in r.get("steps") or [] if s.get(key))
        return values[len(values) // 2] if values else 0
    w, clock = median("gpu_power_w"), median("gpu_sm_clock_mhz")
    energy = f"{1000 * w / t:.1f}" if w and t else "-"
    print(f"| {r['tag']}: {r.get('who')} {r.get('method')} | {r.get('rc')} | {t:,.0f} ({r.get('tokens_per_s_per_gpu_min', 0):,.0f}-"
          f"{r.get('tokens_per_s_per_gpu_max', 0):,.0f}) | {ratio} | {r.get('peak_alloc_gib', 0):.2f} | "
          f"{r.get('peak_alloc_steady_gib') or 0:.2f} | {r.get('peak_reserved_gib', 0):.2f} | "
          f"{w:.0f} | {clock:.0f} | {energy} |")
PY
tar czf "$O/logs.tgz" -C "$O" --exclude=logs.tgz --exclude=table.md . 2>/dev/null
find "$O" -mindepth 1 -maxdepth 1 ! -name table.md ! -name logs.tgz -exec rm -rf {} +
cat "$O/table.md"
