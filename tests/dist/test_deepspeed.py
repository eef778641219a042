"""The DeepSpeed backend on 2 gloo processes: loss parity with FSDP2 and the unsharded run (fp32),
ZeRO-3 partitioning, CPU and NVMe offload, bf16, LoRA under ZeRO-3 (a complete adapter, never an empty one),
export through transformers, and resume from DeepSpeed's own checkpoint format."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import (
    LAYERS,
    MICRO,
    NVME_SKIP,
    PROJECTIONS,
    ROOT,
    assert_same_gradients,
    max_diff,
    op_built,
    run_cli,
    worker_results,
)

from shardtune.models.presets import PRESETS
from shardtune.parallel.deepspeed import async_io_available

pytestmark = pytest.mark.dist
pytest.importorskip("deepspeed")

# NVMe offload needs DeepSpeed's async I/O op, built on first use against libaio (.ci/run installs it). That build
# is ~7 min of C++ on CI's 2 cores (measured: the variant took 416 s of which the run ~5 s), more than half of the
# suite's budget, so it runs where the op is built already or SHARDTUNE_TEST_OP_BUILDS=1 asks for the build.
NVME = async_io_available() and (op_built("async_io") or os.environ.get("SHARDTUNE_TEST_OP_BUILDS") == "1")
NO_LIBAIO = NVME_SKIP if async_io_available() else "libaio is not installed here (.ci/run installs it)"
# zero3:ds:ac:cb1: full checkpointing of the first block only (parallel.checkpoint_blocks, which strategy auto may
# now pick for DeepSpeed candidates too). zero3:ds:ac:tile:nopersist: the MLPs in tiles (parallel.tiled_mlp) under
# ZeRO-3's weight fetches (every weight partitioned and released: nopersist, beside zero3:ds:ac:nopersist) and its
# gradient hooks (each weight's gradient reaches them once, summed over the tiles).
# zero3:ds:ac:actoff: the checkpoint's block inputs in host memory (parallel.activation_offload's hooks).
DS_FP32 = ["ddp:ds", "zero1:ds", "zero2:ds", "zero3:ds", "zero3:ds:ac", "zero3:ds:ac:cb1", "zero3:ds:ac:nopersist",
           "zero3:ds:ac:tile:nopersist", "zero3:ds:ac:actoff", "zero2:ds:offload", "zero3:ds:offparams",
           "zero3:ds:nvme"]
LONG_LORA = "zero2:ds:lora:ac:tile:actoff"  # the long-sequence settings together, under ZeRO-2's gradient buckets
FUSED = "zero2:ds:fused"  # model.liger: loss (its plain-torch contract standing in for Liger's kernel)
# Under ZeRO-3 with every weight partitioned and released (nopersist): the tied head (the 1B shape's kind), an LM
# head of its own (the 8B shapes'), against the plain loss of the same model and engine, and LoRA (a frozen head).
FUSED_ZERO3 = ["zero3:ds:fused:nopersist", "zero3:ds:untied:nopersist", "zero3:ds:untied:fused:nopersist",
               "zero3:ds:lora:fused:nopersist"]
RUNNABLE = [v for v in DS_FP32 if NVME or v != "zero3:ds:nvme"]
TINY = str(ROOT / "examples" / "tiny.yaml")


@pytest.fixture(scope="module")
def results(tmp_path_factory, fsdp2_runs, micro_model_dir):
    """(the FSDP2 launches of tests/conftest.py's fsdp2_runs, this module's DeepSpeed launch)"""
    tmp = tmp_path_factory.mktemp("ds")
    one, fsdp2 = fsdp2_runs
    two = worker_results(tmp / "two", 2, 2, [*RUNNABLE, "zero3:ds:lora", LONG_LORA, "zero3:ds:bf16", FUSED,
                                             *FUSED_ZERO3],
                         env={"SHARDTUNE_TEST_MODEL_DIR": str(micro_model_dir),
                              "SHARDTUNE_TEST_UNTIED_DIR": str(_untied_micro_llama(tmp / "untied"))})
    two["zero2"], two["zero3"] = fsdp2["zero2"], fsdp2["zero3"]
    two["nvme_swap_files"] = sorted(str(p.relative_to(tmp / "two" / "nvme"))
                                    for p in (tmp / "two" / "nvme").rglob("*.swp") if p.stat().st_size > 0)
    return one, two


def _untied_micro_llama(out: Path) -> Path:
    """micro-llama with an LM head of its own, written as transformers writes a model (random init, seed 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.models.presets import preset_config
    from shardtune.models.tokenizer import load_tokenizer

    config = preset_config("micro-llama")
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    load_tokenizer(None).save_pretrained(out)
    return out


@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.skipif(not NVME, reason=NO_LIBAIO))
                                     if v == "zero3:ds:nvme" else v for v in DS_FP32])
def test_deepspeed_matches_unsharded_and_fsdp2(results, variant):
    ref, two = results
    assert two[variant]["world"] == 2
    assert_same_gradients(ref["ddp"], two[variant])
    for fsdp2 in ("zero2", "zero3"):
        assert_same_gradients(two[fsdp2], two[variant])
    assert two[variant]["ds_stage"] == (int(variant[4]) if variant.startswith("zero") else 0)  # the engine ran it
    assert two[variant]["losses"][-1] < two[variant]["losses"][0]
    assert two[variant]["export_logit_diff"] < 1e-5  # OUTPUT/model reloads through transformers


@pytest.mark.skipif(not NVME, reason=NO_LIBAIO)
def test_nvme_offload_keeps_the_optimizer_states_in_the_folder(results):
    swapped = results[1]["nvme_swap_files"]  # its losses are checked with the other variants above
    for rank in (0, 1):
        assert any(f"rank{rank}/exp_avg-" in f for f in swapped), swapped
        assert any(f"rank{rank}/exp_avg_sq-" in f for f in swapped), swapped


def test_zero3_partitions_parameters_and_stage2_does_not(results):
    two = results[1]
    assert two["zero3:ds"]["ds_fraction"] == pytest.approx(0.5, abs=0.01)  # each rank holds half
    assert two["zero2:ds"]["ds_fraction"] is None  # ZeRO-2 keeps whole parameters


def test_zero3_loads_one_decoder_block_at_a_time(results):
    # README: "ZeRO-3 is loaded one decoder block at a time ... so no process holds the whole model". At every read
    # of a weight, the worker summed the parameter bytes the model held in full (tests/dist/worker.py LoadProbe):
    # one block while the blocks load (each partitioned before the next gets storage), then the embeddings and norm.
    for load in results[1]["zero3:ds"]["load"]:
        blocks, whole = load["block_bytes"], load["model_bytes"]
        assert len(blocks) == LAYERS and load["bytes_read"] > 0
        # < whole / 2: never two of micro-llama's blocks at once (each is 37% of the model)
        assert max(blocks) <= load["peak_full_bytes"] <= max(*blocks, whole - sum(blocks)) < whole / 2


def test_bf16_close_to_fp32(results):
    ref, two = results
    assert max_diff(ref["ddp"]["losses"], two["zero3:ds:bf16"]["losses"]) < 2e-2


def test_zero3_lora_saves_a_complete_adapter(results):
    # ZeRO-3 + PEFT saving a 40-byte adapter (peft #2892): every adapter tensor must be gathered.
    ref, two = results
    lora = two["zero3:ds:lora"]
    assert max_diff(ref["ddp:lora"]["losses"], lora["losses"]) < 1e-5
    assert lora["adapter_tensors"] == 2 * PROJECTIONS * LAYERS  # A and B of every adapted projection
    assert lora["adapter_nonzero_b"] == PROJECTIONS * LAYERS  # every B trained away from its zero init
    assert lora["adapter_logit_diff"] < 1e-5  # PeftModel.from_pretrained(base, adapter) = trained model
    assert lora["base_weights_diff"] == 0.0


def test_the_long_sequence_settings_keep_the_gradients_and_move_the_block_inputs(results, fsdp2_runs):
    # LoRA with the MLPs in tiles and the activation offload: ZeRO-2's gradient buckets take each adapter's gradient
    # once, summed over the tiles by autograd. The offload moved what FSDP2's moves (the checkpointed blocks' inputs).
    ref, two = results
    assert_same_gradients(ref["ddp:lora"], two[LONG_LORA])
    assert two[LONG_LORA]["ds_stage"] == 2 and two[LONG_LORA]["offloaded_bytes"] > 0
    assert two["zero3:ds:ac:actoff"]["offloaded_bytes"] == fsdp2_runs[1]["zero3:ac:actoff"]["offloaded_bytes"] > 0


def test_the_fused_loss_gives_the_plain_losses_and_gradients(results):
    # Liger's fused linear + cross-entropy inside the model's forward (models/liger.py), as under FSDP2. Under ZeRO-2
    # the LM head (tied to the embedding here) is whole. ZeRO-3 partitions it, and the fused loss reads it without
    # calling it: the head's weight is an external parameter of the loss's module, gathered for the loss and again
    # for its backward, tied or not.
    ref, two = results
    assert_same_gradients(ref["ddp"], two[FUSED])
    assert_same_gradients(ref["ddp"], two["zero3:ds:fused:nopersist"])
    assert_same_gradients(two["zero3:ds:untied:nopersist"], two["zero3:ds:untied:fused:nopersist"])
    assert_same_gradients(ref["ddp:lora"], two["zero3:ds:lora:fused:nopersist"])
    micro = PRESETS["micro-llama"]
    head = micro["vocab_size"] * micro["hidden_size"]  # the whole head in every call, never a partition
    for variant in (FUSED, "zero3:ds:fused:nopersist", "zero3:ds:untied:fused:nopersist",
                    "zero3:ds:lora:fused:nopersist"):
        calls = two[variant]["fused_calls"]
        assert {tuple(call) for call in calls} == {("Parameter", head)}, variant  # every micro-batch
        assert len(calls) >= 6 * 2  # steps x accumulation
        assert two[variant]["ds_stage"] == int(variant[4])
    assert not two["zero3:ds:untied:nopersist"]["fused_calls"]  # the plain loss ran there
    # and the untied model trained its own head: a different model from the tied one
    assert two["zero3:ds:untied:nopersist"]["losses"] != two["zero3:ds:fused:nopersist"]["losses"]


def _train(out: Path, *extra: str, nproc: int = 2, cache: Path | None = None):
    cached = [f"data.cache_dir={cache}"] if cache else []
    return run_cli("train", TINY, MICRO, *cached, "--nproc", str(nproc), "--output-dir", str(out),
                   "train.max_steps=8", "train.micro_batch_size=4", "train.grad_accum=2", "parallel.backend=deepspeed",
                   "parallel.strategy=zero3", "log.every=1", "log.progress=false", "train.eval_batches=1",
                   "checkpoint.every_steps=3", "checkpoint.save_final=false", *extra)


def _losses(out: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def test_resume_from_a_deepspeed_checkpoint(tmp_path, data_cache):
    full, part = tmp_path / "full", tmp_path / "part"
    first = _train(full, cache=data_cache)
    assert first.returncode == 0, first.stderr[-3000:]
    # No library's deprecation notice among a run's lines (torch 2.13 warned DeepSpeed's every all-gather).
    assert "Warning" not in first.stderr, first.stderr[-3000:]
    stop = _train(part, "train.stop_after_step=5", cache=data_cache)
    assert stop.returncode == 0, stop.stderr[-3000:]
    ckpt = part / "checkpoints" / "step-00000005"
    assert json.loads((ckpt / "manifest.json").read_text())["format"] == "deepspeed"
    assert any((ckpt / "deepspeed" / "state").glob("*optim_states.pt"))
    # Each rank checksummed its own DeepSpeed files (rank 0 read none of rank 1's).
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    for rank in (0, 1):
        own = [name for name in files if f"zero_pp_rank_{rank}_" in name]
        assert own and all(files[name]["by"] == rank for name in own), (rank, own)
    moved = tmp_path / "moved"
    shutil.copytree(part, moved)
    resumed = _train(part, "--resume", cache=data_cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    a, b = _losses(part), _losses(full)
    assert sorted(a) == list(range(1, 9))
    assert max(abs(a[s] - b[s]) for s in b) <= 1e-6

    # DeepSpeed checkpoints resume on the same number of processes and backend only: one line, exit 2.
    other = _train(moved, "--resume", nproc=1)
    assert other.returncode == 2 and "same number" in other.stderr and len(other.stderr.strip().splitlines()) == 1
    fsdp = _train(moved, "parallel.backend=fsdp2", "--resume")
    assert fsdp.returncode == 2 and "deepspeed backend" in fsdp.stderr


def test_fp16_on_cpu_is_refused_in_one_line(tmp_path):
    # DeepSpeed raises "Type fp16 is not supported on your device" with a traceback from every rank.
    run = _train(tmp_path / "fp16", "train.precision=fp16", "parallel.strategy=zero2")
    assert run.returncode == 2, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "DeepSpeed has no fp16 on CPU" in lines[0] and "Traceback" not in run.stderr


def test_deepspeed_collectives_are_counted(results):
    # The same accounting as FSDP2 (tests/dist/test_comm.py), through deepspeed.comm. 2 ranks, grad_accum 2, fp32.
    two = results[1]
    params = two["ddp:ds"]["numel"]["params"] * 4  # bytes (ZeRO-3 partitions leave numel 0, stage 0 does not)
    ddp = two["ddp:ds"]["comm"]["bus_bytes_per_step"]
    assert 0 <= ddp["all_reduce"] - 2 * params / 2 < 64  # every gradient once per step, + bookkeeping scalars
    z1, z2 = two["zero1:ds"]["comm"], two["zero2:ds"]["comm"]
    assert 0 <= z1["bus_bytes_per_step"]["all_reduce"] - 2 * params / 2 < 64  # once a step, at its boundary
    # Stage 2 reduces each micro-batch's gradients; one reduce bucket holds slices of both ranks' partitions, so
    # DeepSpeed all-reduces it whole (use_multi_rank_bucket_allreduce), not a reduce-scatter.
    assert 0 <= z2["bus_bytes_per_step"]["all_reduce"] - 2 * (2 * params / 2) < 64
    for z in (z1, z2):  # the updated partitions, gathered once a step
        assert z["bus_bytes_per_step"]["all_gather"] == params / 2
        assert set(z["bus_bytes_per_step"]) == set(z["predicted_bus_bytes_per_step"])  # the planner's kinds
        for kind, predicted in z["predicted_bus_bytes_per_step"].items():
            assert 0 <= z["bus_bytes_per_step"][kind] - predicted < 64, kind
    z3 = two["zero3:ds"]["comm"]
    assert z3["bus_bytes_per_step"]["reduce_scatter"] == params / 2 * 2  # fp32 gradients, each micro-batch
    # Parameters under stage3_param_persistence_threshold stay whole on every rank: gathered less than the
    # planner's every-parameter-twice-per-micro-batch.
    assert 0 < z3["bus_bytes_per_step"]["all_gather"] <= z3["predicted_bus_bytes_per_step"]["all_gather"]
    # With every weight released (nopersist), from the second step on each parameter is gathered exactly twice per
    # micro-batch (forward, and the recompute that full checkpointing runs before the backward): the planner's count
    # to the byte, read off metrics.jsonl's last step; the MLPs in tiles too. The first step gathers more (the run's
    # average is 4.7-7.8% above): while DeepSpeed records its trace of the module order it releases each block's
    # weights after the recompute and gathers them a third time for the backward, and without the MLPs as ZeRO-3
    # leaves (`_gather_each_mlp_once`) it gathers each projection again for every tile (the run's average 37% above).
    # Counted per parameter by bench/probe_zero3_gathers.py (bench/RESULTS.md, fiftieth session).
    predicted = two["zero3:ds:ac:nopersist"]["comm"]["predicted_bus_bytes_per_step"]["all_gather"]
    for variant in ("zero3:ds:ac:nopersist", "zero3:ds:ac:tile:nopersist"):
        assert two[variant]["logged"]["comm_all_gather_bytes"] == predicted, variant
        assert predicted <= two[variant]["comm"]["bus_bytes_per_step"]["all_gather"] < 1.1 * predicted, variant


def test_deepspeed_runs_prove_their_features(results):
    two = results[1]
    assert two["zero3:ds:ac"]["mlp_calls"] == 2 * two["zero3:ds"]["mlp_calls"] == 2 * LAYERS * 6 * 2  # recomputed
    assert two["zero3:ds:ac:cb1"]["mlp_calls"] == (LAYERS + 1) * 6 * 2  # the first block's only
    assert two["zero3:ds:bf16"]["activation_dtypes"] == ["bfloat16"]
    assert two["zero3:ds"]["activation_dtypes"] == ["float32"]
    assert two["zero3:ds:lora"]["ds_stage"] == two["zero3:ds:bf16"]["ds_stage"] == 3
