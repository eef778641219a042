"""The planner against every peak-memory measurement on record (bench/planner_accuracy_*.jsonl: real runs on one
H200, or on two where a row says `world: 2`, each row named after its overrides in bench/planner_accuracy.py's
MATRICES). The planner is a pure function of the config, so the landed code's predictions are recomputed here and
must stay within 5% of what was measured, as README.md claims: a change to the memory model that breaks a measured
row fails here, without a GPU."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import ROOT

from shardtune.config import load_config
from shardtune.models.build import load_hf_config
from shardtune.plan import predict_run
from shardtune.plan.hardware import lookup

# Rows the model does not explain yet, with their error (bench/RESULTS.md). The 8B LoRA / QLoRA + Liger rows were
# 13-27% low until the third session of 2026-12-02: their memory snapshot showed FSDP2's gathered root (embedding
# and head, 2 x 1002 MiB) alive while the fused loss runs; now within 5%, but with compiled blocks 7% low (0.7 GiB
# not explained). (LoRA with selective checkpointing was 20% low until 2026-12-04: the adapters' matmuls shift
# which outputs it saves; now -2.5%.) ddp on one GPU 3.1 GiB above (its bf16 copy of the parameters and fp32
# gradients are not what the model assumes there). DeepSpeed stage 0 with LoRA (2026-12-04) 4 GiB below the count.
# Compiled blocks under full checkpointing (8B LoRA / QLoRA, third session) hold ~1 GiB more than the eager ones:
# -5% and -10%; what it is needs a snapshot, which PyTorch 2.11 cannot record for them (pytorch/pytorch#179536).
# The backward's MLP gradients (memory.backward_transient, 2026-12-04) explain part: now -4% (LoRA), -5% and -8%.
# The same compiled QLoRA row with the frozen base whole (2026-12-04, call 38/40): -8.3%, the same ~0.7 GiB; and
# again under FSDP2 and under parallel.one_gpu: direct (calls 48, 50: -8.4%; direct's peak is FSDP2's to 1 MB),
# and on the defaults (call 52: -8.4%). The twenty-sixth session's 8B QLoRA at 131,072 tokens with compiled blocks and
# activation offload was 30% low (12.95 GiB, on an H100): the compiled backward's excess grows with the tokens, about
# 3.6 x p x f per token (memory.COMPILED_BACKWARD); with it every compiled row under checkpointing is within 5%
# (LoRA +0.0%, QLoRA -3.5% to -4.1%: its NF4 weights' bf16 copies, ~0.3 GiB).
# The checkpoint inside the compiled blocks (parallel.checkpoint_in_compile, twenty-seventh session, calls 79-80) holds
# 0.36-0.57 GiB more than around them (8B LoRA float8 at micro-batch 2 / 4): -3.0% and -4.6% priced alike, within
# 1.1% with memory.INSIDE_RECOMPUTE (3.5pf since calls 109-113, fitted on 8B QLoRA at 32,768-131,072 tokens); its
# speed is priced without the down projection's recompute (it was 10-13% over the prediction).
# 8B LoRA at micro-batch 2 with the activation offload, inside, direct (call 125): 5.8% low, its peak not in training
# but while the model loaded (the preset's fp32 draw of the embedding beside the whole bf16 model: 17.13 GiB, as at
# micro-batch 3 and the default; the init draws in the parameter's dtype since, models/weights.py).
KNOWN_MISSES = {"1b-ddp-mb4-compile-ligerloss": 0.09, "8b-lora-alt-deepspeed-ddp-none-none-mb4": 0.06,
                "8b-lora-mb2-ac-compile-ligerloss-offload-inside-direct": 0.06}
# tokens/s: within 15% but the two noisiest rows on record (call 16: min-max 28,780-35,751 and 23,313-30,982;
# an earlier session measured the second at 30,358, 4% from the prediction; 30.0% -> 30.03% with the 2026-12-04
# refit that gave attention its own rate, which moved the 1B rows up ~1%: the 8-bit rows below went 16.6 -> 18.0%
# and 22.2 -> 23.5%).
# 2026-12-04: 8-bit AdamW at micro-batch 8 and 16 (selective) ran 11-20% under the prediction with wide spreads
# (34,747-39,674 and 36,992-40,427 tokens/s: torchao's optimizer step is host-bound); 8B QLoRA at micro-batch 2
# without checkpointing spread 7,632-10,818 (+20%).
# Selective checkpointing ran 5-29% under the prediction on every row (with PEFT 20-29%) until its per-layer cost
# (speed.SELECTIVE_LAYER_S, 2026-12-04, sixteenth session) went in: now within 9%, and none is a miss.
# The H100's GEMM efficiency fitted to its rows (0.80 -> 0.82, forty-sixth session) raised its prices 2.5%: the
# host-paced float8 row of call 82 (HOST_BOUND below) went 13.8 -> 16.4% over, and 8B QLoRA at 32,768 tokens under
# the offload and budget 0.3 (call 138, its memory priced 3.9% low) 12.7 -> 15.2%.
SPEED_MISSES = {("16", "1b-zero2-mb2"): 0.20, ("16", "1b-ds-zero3-mb4"): 0.31,
                ("32", "1b-8bit-alt-mb-fsdp2-zero2-none-none-mb8"): 0.24,
                ("33", "8b-qlora-alt-mb-fsdp2-zero2-none-none-mb2"): 0.21,
                ("82", "8b-lora-mb2-ac-compile-ligerloss-float8t-auto"): 0.17,
                ("138", "8b-qlora-long-offload_budget-32768"): 0.16}
# parallel.shard_frozen became `auto` (false on one process) after call 40; earlier rows ran with it true unless
# their overrides say otherwise.
FROZEN_AUTO_CALL = 41
# model.liger_chunk and parallel.one_gpu became `auto` after call 46 (seventeenth session); earlier rows ran with
# Liger's own chunk and FSDP2 on one process unless their overrides say otherwise.
CHUNK_DIRECT_AUTO_CALL = 47
# model.liger_chunk: auto became 1024 for LoRA / QLoRA too after call 53 (nineteenth session); their earlier rows ran
# with Liger's own chunk unless their overrides say otherwise.
PEFT_CHUNK_AUTO_CALL = 54
# peft.base_dtype: auto keeps float8 LoRA's base as its casts since the twenty-fifth session (after call 74); earlier
# float8 rows cast every pass unless their overrides say otherwise.
FLOAT8_BASE_AUTO_CALL = 75
# parallel.checkpoint_in_compile became `auto` (inside without activation offload) after call 84 (twenty-eighth
# session); earlier compiled rows under checkpointing ran with the checkpoint around the blocks unless their
# overrides say otherwise.
CKPT_INSIDE_AUTO_CALL = 85
# optim.fused: auto takes the compiled update (bf16 full fine-tuning with compiled blocks on the one-GPU direct path,
# one micro-batch a step) after call 91 (thirty-second session); earlier rows ran torch's fused AdamW unless their
# overrides say otherwise.
COMPILED_UPDATE_AUTO_CALL = 92
# model.liger_accum became `weight` (the head's gradient summed in bf16, Liger's own default) after call 100
# (thirty-fourth session); earlier rows summed it in fp32 unless their overrides say otherwise.
LIGER_ACCUM_WEIGHT_CALL = 101
# peft.offload_embedding became `auto` (LoRA / QLoRA's untied input embedding on the host on the one-GPU direct
# path) after call 103 (thirty-fourth session); earlier rows kept it on the GPU unless their overrides say otherwise.
OFFLOAD_EMBEDDING_AUTO_CALL = 104
# parallel.one_gpu: auto runs LoRA / QLoRA with parallel.activation_offload direct after call 138 (forty-fourth
# session); earlier rows with the offload ran under FSDP2 unless their overrides say otherwise.
OFFLOAD_DIRECT_AUTO_CALL = 139


def _matrix() -> dict[str, list[str]]:
    spec = importlib.util.spec_from_file_location("planner_accuracy", ROOT / "bench" / "planner_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: overrides for rows in module.MATRICES.values() for name, _, overrides in rows}


def _rows() -> list[dict]:
    rows = []
    for path in sorted((ROOT / "bench").glob("planner_accuracy_*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("meas_alloc")]


def _predictions() -> list[tuple[dict, object]]:
    """(row, the landed planner's prediction for it) for every run on record that ran as configured."""
    matrix, out = _matrix(), []
    for row in _rows():
        overrides = row.get("overrides") or matrix[row["name"]]  # pick rows (--pick) record their own
        if int(row["call"]) < FROZEN_AUTO_CALL:
            overrides = ["parallel.shard_frozen=true", *overrides]  # the default when they ran
        if int(row["call"]) < CHUNK_DIRECT_AUTO_CALL:
            overrides = ["model.liger_chunk=0", "parallel.one_gpu=fsdp2", *overrides]
        elif int(row["call"]) < PEFT_CHUNK_AUTO_CALL and any(o.startswith("peft.method=") and not o.endswith("none")
                                                           for o in overrides):
            overrides = ["model.liger_chunk=0", *overrides]
        if int(row["call"]) < FLOAT8_BASE_AUTO_CALL and "train.float8=tensorwise" in overrides:
            overrides = ["peft.base_dtype=bf16", *overrides]  # float8 runs bf16
        if int(row["call"]) < CKPT_INSIDE_AUTO_CALL and not any(o.startswith("parallel.checkpoint_in_compile=")
                                                               for o in overrides):
            overrides = ["parallel.checkpoint_in_compile=false", *overrides]
        if int(row["call"]) < COMPILED_UPDATE_AUTO_CALL and not any(o.startswith("optim.fused=") for o in overrides):
            overrides = ["optim.fused=true", *overrides]
        if int(row["call"]) < LIGER_ACCUM_WEIGHT_CALL and not any(o.startswith("model.liger_accum=")
                                                                  for o in overrides):
            overrides = ["model.liger_accum=fp32", *overrides]
        if int(row["call"]) < OFFLOAD_EMBEDDING_AUTO_CALL and not any(o.startswith("peft.offload_embedding=")
                                                                      for o in overrides):
            overrides = ["peft.offload_embedding=false", *overrides]
        if int(row["call"]) < OFFLOAD_DIRECT_AUTO_CALL and "parallel.activation_offload=true" in overrides \
                and not any(o.startswith("parallel.one_gpu=") for o in overrides):
            overrides = ["parallel.one_gpu=fsdp2", *overrides]
        cfg = load_config(str(ROOT / "bench" / "bench.yaml"), ["data.train_file=examples/data/tasks.jsonl", *overrides])
        if "auto" in (cfg.parallel.strategy, cfg.train.micro_batch_size):
            continue  # the pick: priced with the search, not as configured
        world = int(row.get("world", 1))  # processes, one GPU each, on one node
        gpu = lookup(row.get("gpu", "h200"))  # the H200 unless the row names another
        out.append((row, predict_run(cfg, load_hf_config(cfg.model), gpu, world=world, per_node=world)))
    return out


def test_every_recorded_peak_is_predicted_within_5_percent() -> None:
    errors = {}
    for row, predicted in _predictions():
        err = predicted.memory.allocated / 2**30 / row["meas_alloc"] - 1
        errors[f"{row['call']}:{row['name']}"] = round(err, 3)
        assert abs(err) <= KNOWN_MISSES.get(row["name"], 0.05), (row["name"], row["call"], err, row)
    assert len(errors) >= 24, errors  # every row on record, the Liger rows of 2026-12-02 included
    assert any("liger" in k for k in errors)


def test_compiled_qlora_peaks_count_the_dequantised_weights() -> None:
    """plan/memory.py NF4_COMPILED_COPIES: every compiled 8B QLoRA row at 4,096 tokens from call 26 on was
    0.29-0.35 GiB low without it (-3.5% to -4.1%); with it each is within 1%. (At 32,768-131,072 tokens the copies
    are under 1.5% of the peak, and the rows within 2.5%: the 5% test above holds them.)"""
    errors = {}
    for row, predicted in _predictions():
        if (row["name"].startswith("8b-qlora") and "compile" in row["name"] and "long" not in row["name"]
                and int(row["call"]) >= 26):
            errors[f"{row['call']}:{row['name']}"] = predicted.memory.allocated / 2**30 / row["meas_alloc"] - 1
    assert len(errors) >= 15, errors
    assert all(abs(err) <= 0.01 for err in errors.values()), errors


def test_the_checkpoint_inside_is_priced_at_long_sequences() -> None:
    """plan/memory.py INSIDE_RECOMPUTE: 8B QLoRA with the checkpoint inside the compiled blocks at 32,768-131,072
    tokens (calls 109-115) held 3.5 x p x f bytes per token over around; the 2pf + 0.15 GiB fitted on 4,096-8,192
    tokens priced them 3.0-8.0% low. Within 2.5% now, none more than 1% under (call 124's offload_inside at 32,768
    tokens on an H100: 0.5% under, 0.1 GiB; the rest none under)."""
    errors = {f"{row['call']}:{row['name']}": predicted.memory.allocated / 2**30 / row["meas_alloc"] - 1
              for row, predicted in _predictions()
              if row["name"].startswith("8b-qlora-long-") and ("-compile-" in row["name"] or "inside" in row["name"])}
    assert len(errors) >= 4, errors
    assert all(-0.01 <= err <= 0.025 for err in errors.values()), errors

# Reserved (what must fit): 8B QLoRA mb 4 with checkpointing (call 16) reserved 5.3 GiB over its allocated, 14% more
# than the fragmentation share says. 8B LoRA bf16 at activation memory budget 0.3 (call 94) +11%, on the side of not
# fitting: it kept 0.30 of the way to none where BUDGET_KEPT (fitted on float8 rows) says 0.37 (allocated +3.4%), and
# reserved 1.022 x its allocated where PEFT_FRAGMENTATION says 1.10 (LoRA rows measured 1.02-1.18).
RESERVED_MISSES = {"8b-qlora-mb4-ac": 0.15, "8b-lora-mb2-compile-ligerloss-budget0.3": 0.12}


def test_every_recorded_reserve_is_predicted_within_10_percent() -> None:
    """The allocator's reserve, what decides whether a run fits: the long-sequence rows (calls 35-36) reserved up
    to 32 GiB over their allocated, which the share-of-allocated model put at 9."""
    checked = 0
    for row, predicted in _predictions():
        if row.get("meas_reserved"):
            err = predicted.memory.reserved / 2**30 / row["meas_reserved"] - 1
            assert abs(err) <= RESERVED_MISSES.get(row["name"], 0.10), (row["name"], row["call"], err)
            checked += 1
    assert checked >= 50


def test_recorded_host_memory_is_predicted_within_10_percent() -> None:
    """Host memory in use (`free`, less the idle machine's) during the long-sequence runs of calls 35-36: the
    pinned block inputs and final norm of activation offload, or the process alone."""
    checked = 0
    for row, predicted in _predictions():
        if row.get("meas_host_gib"):
            err = predicted.memory.host_total / 2**30 / row["meas_host_gib"] - 1
            assert abs(err) <= 0.10, (row["name"], row["call"], err)
            checked += 1
    assert checked >= 4


def test_every_recorded_speed_is_predicted_within_15_percent() -> None:
    errors = {}
    for row, predicted in _predictions():
        if row["meas_tps"] is None:  # a peak-memory row whose speed was not steady (the row's note says why)
            continue
        err = predicted.time.tokens_per_sec_per_gpu / row["meas_tps"] - 1
        errors[f"{row['call']}:{row['name']}"] = round(err, 3)
        assert abs(err) <= SPEED_MISSES.get((str(row["call"]), row["name"]), 0.15), (row["name"], row["call"], err)
    assert len(errors) >= 24, errors


def test_compiled_peft_with_the_fused_loss_is_priced_within_8_percent() -> None:
    """LoRA / QLoRA with compiled blocks and model.liger: loss (the fastest PEFT setting, which README quotes):
    every row ran 6-14% faster than priced until LIGER_EFF["peft_compiled_loss"] (eighteenth session). 8B QLoRA on an
    H100 with the checkpoint inside the blocks ran 7.3-8.9% faster than priced (calls 83-104) until compiled blocks
    were priced at two dequantisations a micro-batch, not three (speed.dequant_passes, thirty-seventh session)."""
    errors = {f"{row['call']}:{row['name']}": predicted.time.tokens_per_sec_per_gpu / row["meas_tps"] - 1
              for row, predicted in _predictions() if "lora" in row["name"] and "compile-ligerloss" in row["name"]}
    assert len(errors) >= 17, errors
    assert all(abs(e) <= HOST_BOUND.get(k, 0.08) for k, e in errors.items()), errors


def test_the_h100s_full_fine_tuning_with_the_fused_loss_is_priced_within_5_percent() -> None:
    """Liger's fused loss adds each chunk's share of the LM head's gradient into its accumulator; that traffic with
    Liger's own chunk is inside LIGER_EFF at the H200's bandwidth, where it was fitted, and takes longer on the
    H100's slower HBM. Priced at the H200's, the H100's 1B rows (calls 85-118) ran 5.1-7.8% slower than priced
    (speed.LIGER_FIT_HBM, thirty-seventh session)."""
    errors = {f"{row['call']}:{row['name']}": predicted.time.tokens_per_sec_per_gpu / row["meas_tps"] - 1
              for row, predicted in _predictions()
              if row.get("gpu") == "h100" and row["name"].startswith("1b") and "ligerloss" in row["name"]
              and row["meas_tps"]}
    assert len(errors) >= 16, errors
    assert all(abs(e) <= 0.05 for e in errors.values()), errors


# 8B LoRA in float8 at micro-batch 2 is paced by the host, whose speed moved between calls on the same H100 (calls
# 75 and 77, bench/RESULTS.md twenty-sixth session: 13,617 and 11,994 tokens/s, the GPU 50-100% busy below its power
# cap); the planner prices the GPU's work (13,371). At micro-batch 4 the same runs are GPU-bound (14,545 and 14,551).
# Call 82 again (the checkpoint around the blocks; its steps -15% / +24% of the median). 0.12 and 0.15 until the
# H100's GEMM efficiency was fitted (forty-sixth session: +2.5% on every H100 price).
# Call 74's float8 rows, the first on the H100, ran slower than the same settings later (11,672 and 12,578 tokens/s;
# call 78 the first at 13,867): 5.9% and 6.3% over, 8.2% and 8.7% since the fit.
HOST_BOUND = {"77:8b-lora-mb2-ac-compile-ligerloss-float8t-auto": 0.15,
              "82:8b-lora-mb2-ac-compile-ligerloss-float8t-auto": 0.17,
              "74:8b-lora-mb2-ac-compile-ligerloss-float8t": 0.09,
              "74:8b-lora-mb2-ac-compile-ligerloss-float8t-base": 0.09}


@pytest.mark.parametrize("name", sorted(KNOWN_MISSES))
def test_known_misses_are_still_on_record(name: str) -> None:
    assert any(r["name"] == name for r in _rows())


def test_readme_states_the_accuracy_of_the_rows_on_record() -> None:
    """README.md's accuracy paragraph counts what is on record: a row added (or a planner change) that moves a count
    fails here until the paragraph says so."""
    import re

    readme = (ROOT / "README.md").read_text()
    preds = _predictions()
    alloc = [abs(p.memory.allocated / 2**30 / r["meas_alloc"] - 1) for r, p in preds]
    reserved = [abs(p.memory.reserved / 2**30 / r["meas_reserved"] - 1) for r, p in preds if r.get("meas_reserved")]
    speed = [abs(p.time.tokens_per_sec_per_gpu / r["meas_tps"] - 1) for r, p in preds if r.get("meas_tps")]
    n = len(preds)
    assert re.search(rf"Accuracy, {n} runs through the real CLI on record", readme)
    assert f"within 5% on {sum(e <= 0.05 for e in alloc)} and within 10% on all {n}" in readme
    assert max(alloc) <= 0.10
    assert f"within 10% on {sum(e <= 0.10 for e in reserved)} of {len(reserved)}" in readme
    assert (f"Tokens/s within 5% on {sum(e <= 0.05 for e in speed)}, within 10% on {sum(e <= 0.10 for e in speed)} and "
            f"within 15% on {sum(e <= 0.15 for e in speed)} of the {len(speed)} with a steady speed") in readme
    # the summary at the top says the same (it had kept an earlier count, 109 of 111)
    summary = " ".join(readme.split("predicts peak GPU memory", 1)[1].split()[:40])
    assert summary.startswith(f"within 5% on {sum(e <= 0.05 for e in alloc)} of {n} runs measured on H200s and H100s "
                              f"and within 10% on all {n} ")
    assert (f"tokens/s within 15% on {sum(e <= 0.15 for e in speed)} of the {len(speed)} with a steady speed"
            in summary)
