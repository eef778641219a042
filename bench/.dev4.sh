#!/bin/bash
set -u
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/src NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
SKIP_INSTALL=1 SIZE=1b STEPS=20 WARMUP=8 OUT=/tmp/oA T=95 BUDGET=190 MIN_T=40 VARIANTS="zero2_ds" BASELINES=hf_ds2 BEXTRA="--steps 16" bash bench/core.sh > /tmp/oA.txt 2>&1
tail -n 4 /tmp/oA/table.md
