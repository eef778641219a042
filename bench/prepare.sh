#!/bin/bash
# Host-side preparation for bench/core.sh (run here, not on the device, with the venv active):
#   . /work/venv/bin/activate && bash bench/prepare.sh
# 1. downloads the wheels the GPU machine lacks into .whl/ (shared wheels.sh; builds a pure-Python
#    deepspeed wheel), then drops the ones this benchmark does not use (KEEP_ALL_WHEELS=1 keeps them);
# 2. copies the reference baseline (hf_baseline.py + run_hf_baseline.sh) into .anchors/ (git-ignored);
# 3. prints the sizes: the working tree that travels to the device is capped at 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-}
if [ -z "$SHARED" ]; then
  for d in /work/shared/device ../shared/device shared/device; do [ -f "$d/wheels.sh" ] && { SHARED=$d; break; }; done
fi
[ -n "$SHARED" ] || { echo "cannot find shared/device/wheels.sh; set SHARED=DIR" >&2; exit 1; }

bash "$SHARED/wheels.sh"
if [ "${KEEP_ALL_WHEELS:-0}" != 1 ]; then
  # Needed here: deepspeed (+ hjson; its other requirements are on the device), pydantic, pydantic-core,
  # annotated-types, typing-inspection, typing_extensions (pydantic needs >= 4.16), liger_kernel (0.9 MB,
  # pure Python on the device's Triton: model.liger and HF_LIGER=1 in bench/table1.sh).
  # bitsandbytes (trimmed to CPU + CUDA 13 by wheels.sh) and torchao stay: QLoRA in bench/table2.sh (HF + PEFT
  # baseline: bitsandbytes; shardtune: torchao NF4).
  for p in datasets dill multiprocess typer shellingham; do
    rm -f .whl/"$p"-*.whl
  done
fi

mkdir -p .anchors
cp "$SHARED/hf_baseline.py" "$SHARED/run_hf_baseline.sh" .anchors/
if ! git check-ignore -q .anchors/hf_baseline.py 2>/dev/null; then
  grep -qxF '/.anchors/' .git/info/exclude 2>/dev/null || echo '/.anchors/' >> .git/info/exclude
fi

ls -l .whl
total=$(du -cb .whl .anchors | tail -1 | cut -f1)
echo "carried: .whl + .anchors = $((total / 1024)) KiB (cap for the whole travelling tree: 64 MiB)"
[ "$total" -lt $((60 * 1024 * 1024)) ] || echo "WARNING: over 60 MiB; drop wheels this run does not need" >&2
