#!/bin/bash
# session 3, call 2: DeepSpeed rows on 1 GPU (1B): zero2 overlap_comm on/off vs hf_ds2; zero3+offload vs HF Trainer
# with the emitted config; fsdp2 zero2 fp16 after the fused-AdamW fix
set -u
cd "$(dirname "$0")/.."
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/src NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
left() { echo $((570 - (SECONDS - T0))); }
C="SKIP_INSTALL=1 SIZE=1b STEPS=25 WARMUP=10"
echo "== A t+$((SECONDS - T0))"
env $C OUT=/tmp/oA T=110 BUDGET=$(( $(left) - 300 )) VARIANTS="zero2_ds" BASELINES=hf_ds2 BEXTRA="--steps 20" bash bench/core.sh > /tmp/oA.txt 2>&1
echo "== B t+$((SECONDS - T0))"
env $C OUT=/tmp/oB T=90 BUDGET=160 VARIANTS="zero2_ds" BASELINES="" EXTRA="deepspeed.zero_optimization.overlap_comm=false" bash bench/core.sh > /tmp/oB.txt 2>&1
env $C OUT=/tmp/oC T=90 BUDGET=100 VARIANTS="zero2" BASELINES="" PREC=fp16 bash bench/core.sh > /tmp/oC.txt 2>&1
echo "== D t+$((SECONDS - T0))"
env $C OUT=/tmp/oD T=170 BUDGET=180 VARIANTS="zero3_ds_oo" BASELINES="" bash bench/core.sh > /tmp/oD.txt 2>&1
echo "== E t+$((SECONDS - T0))"
python3 -m shardtune plan bench/bench.yaml --emit deepspeed parallel.backend=deepspeed parallel.strategy=zero3 \
  parallel.offload=optimizer train.micro_batch_size=4 > /tmp/ds_z3oo.json 2>/tmp/emit.err
python3 - <<'PY'
import json; d = json.load(open("/tmp/ds_z3oo.json")); d.pop("optimizer"); json.dump(d, open("/tmp/ds_z3oo_torch.json", "w"))
PY
timeout $(( $(left) - 60 )) python3 -m torch.distributed.run --standalone --nproc_per_node=1 bench/hf_trainer_baseline.py \
  --mode full --size 1b --mbs 4 --no-ac --steps 20 --warmup 8 --deepspeed /tmp/ds_z3oo.json > /tmp/oE.txt 2>&1
echo "rc=$?"; grep RESULT /tmp/oE.txt
echo "== F t+$((SECONDS - T0))"
timeout $(( $(left) - 5 )) python3 -m torch.distributed.run --standalone --nproc_per_node=1 bench/hf_trainer_baseline.py \
  --mode full --size 1b --mbs 4 --no-ac --steps 8 --warmup 3 --deepspeed /tmp/ds_z3oo_torch.json > /tmp/oF.txt 2>&1
echo "rc=$?"; grep RESULT /tmp/oF.txt
for x in A B C D; do echo "## $x"; tail -n 6 /tmp/o$x/table.md; done
tar czf "$OUT/raw.tgz" /tmp/o?.txt /tmp/o?/logs.txt /tmp/o?/table.md /tmp/o?/results.jsonl /tmp/ds_z3oo.json /tmp/emit.err 2>/dev/null
echo "== done t+$((SECONDS - T0))"
