#!/bin/bash
# session 3, call 3: ZeRO-3 + optimizer offload, 1B, 1 GPU: shardtune vs HF Trainer with the emitted config
set -u
cd "$(dirname "$0")/.."
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/src NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
left() { local l=$((560 - (SECONDS - T0) - ${1:-0})); [ "$l" -lt 1 ] && l=1; echo $l; }
echo "== D t+$((SECONDS - T0))"
SKIP_INSTALL=1 SIZE=1b STEPS=20 WARMUP=8 OUT=/tmp/oD T=170 BUDGET=185 VARIANTS="zero3_ds_oo" BASELINES="" bash bench/core.sh > /tmp/oD.txt 2>&1
tail -n 3 /tmp/oD/table.md
python3 -m shardtune plan bench/bench.yaml --emit deepspeed parallel.backend=deepspeed parallel.strategy=zero3 \
  parallel.offload=optimizer train.micro_batch_size=4 > /tmp/ds_z3oo.json 2>/tmp/emit.err
python3 - <<'PY'
import json; d = json.load(open("/tmp/ds_z3oo.json")); d.pop("optimizer"); json.dump(d, open("/tmp/ds_z3oo_torch.json", "w"))
PY
echo "== E t+$((SECONDS - T0))"
timeout $(left 100) python3 -m torch.distributed.run --standalone --nproc_per_node=1 bench/hf_trainer_baseline.py \
  --mode full --size 1b --mbs 4 --no-ac --steps 20 --warmup 8 --deepspeed /tmp/ds_z3oo.json > /tmp/oE.txt 2>&1
echo "rc=$?"; grep RESULT /tmp/oE.txt || tail -n 5 /tmp/oE.txt
echo "== F t+$((SECONDS - T0))"
timeout $(left) python3 -m torch.distributed.run --standalone --nproc_per_node=1 bench/hf_trainer_baseline.py \
  --mode full --size 1b --mbs 4 --no-ac --steps 7 --warmup 3 --deepspeed /tmp/ds_z3oo_torch.json > /tmp/oF.txt 2>&1
echo "rc=$?"; grep RESULT /tmp/oF.txt || tail -n 5 /tmp/oF.txt
tar czf "$OUT/raw.tgz" /tmp/o?.txt /tmp/oD/logs.txt /tmp/oD/table.md /tmp/ds_z3oo*.json /tmp/emit.err 2>/dev/null
echo "== done t+$((SECONDS - T0))"
