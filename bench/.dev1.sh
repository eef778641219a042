#!/bin/bash
# session 3, call 1: kept stager on torch 2.11; checkpoint bench 1B; fp16 on GPU
set -u
cd "$(dirname "$0")/.."
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/src NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
df -h /tmp | tail -1
echo "== torch 2.11 staging close() calls"
python3 - <<'PY'
import inspect, torch.distributed.checkpoint.staging as st, torch.distributed.checkpoint.state_dict_saver as sv
import torch.distributed.checkpoint._state_dict_stager as sds
for mod in (st, sv, sds):
    for i, line in enumerate(inspect.getsource(mod).splitlines()):
        if "close()" in line or "_deepcopy_dispatch.clear" in line or "_cached_storage_mapping.clear" in line:
            print(mod.__name__.split(".")[-1], i + 1, line.strip())
PY
echo "== kept stager on GPU: 3 stagings of 4 GiB"
python3 - <<'PY'
import time, torch
from shardtune.checkpoint.dcp import kept_stager
s = kept_stager(True)
w = torch.randn(1 << 30, device="cuda")
ptrs = []
for i in range(3):
    w.add_(1); t = time.perf_counter(); r = s.stage({"w": w, "c": {"k": type}}).result()
    ok = torch.equal(r["w"][:1000].cuda(), w[:1000])
    print(f"staging {i}: {time.perf_counter() - t:.3f} s pinned={r['w'].is_pinned()} same_buffer={r['w'].data_ptr() in ptrs} equal={ok}")
    ptrs.append(r["w"].data_ptr())
    s._state_dict_stager.close(); s.close()
s.release()
PY
echo "== checkpoint bench t+$((SECONDS - T0))"
timeout 330 python3 bench/checkpoint.py --size 1b --out /tmp/ck --steps 320 --every 120 2>&1 | tail -8
cp /tmp/ck/checkpoint_results.jsonl /tmp/ck/sync.log /tmp/ck/async.log "$OUT"/ 2>/dev/null
rm -rf /tmp/ck
echo "== fp16 on GPU t+$((SECONDS - T0))"
B=$((560 - (SECONDS - T0)))
OUT=/tmp/fp16out SKIP_INSTALL=1 SIZE=1b STEPS=25 WARMUP=10 T=100 BUDGET=$B VARIANTS="zero2_ds zero2" BASELINES="" PREC=fp16 bash bench/core.sh 2>&1 | tail -8
cp /tmp/fp16out/logs.txt "$OUT"/fp16_logs.txt; cp /tmp/fp16out/table.md "$OUT"/fp16_table.md
echo "== done t+$((SECONDS - T0))"
