"""Loss parity of every strategy against the unsharded single-process run (2 gloo processes, fp32).

One launch runs all 2-process variants (start-up is the expensive part on CPU); the reference is
one process with grad_accum 4, i.e. the same global batches as 2 processes x grad_accum 2. Both launches
are the session's `fsdp2_runs` (tests/conftest.py: their variants are listed there); the DeepSpeed tests
compare against the same runs.
"""

from __future__ import annotations

import pytest
from conftest import LAYERS, PROJECTIONS, assert_same_gradients, max_diff, worker_results

pytestmark = pytest.mark.dist

# zero3:ac:compile: the checkpoint inside each compiled block (checkpoint_in_compile: auto); :around, FSDP2's
# hooks outside the checkpoint around each compiled block; zero3:compile:budget, compile's partitioner recomputing
# under parallel.activation_memory_budget 0.3; :actoff, the saved activations kept in host memory on each rank
# (parallel.activation_offload: the checkpoint's block inputs, and what the budget keeps of each compiled block);
# :cb1, full checkpointing of the first block only (parallel.checkpoint_blocks=1), eager and inside compiled blocks,
# and with the offload (the first block's input to the host, the second block's activations on the device);
# :tile, each block's MLP in tiles of 16 tokens (parallel.tiled_mlp), with the checkpoint and the offload
FP32 = ["ddp", "zero2", "zero3", "zero3:ac", "zero3:compile", "zero3:ac:compile", "zero3:ac:compile:around",
        "zero3:compile:budget", "zero3:ac:actoff", "zero3:compile:budget:actoff", "zero3:ac:cb1",
        "zero3:ac:compile:cb1:aot", "zero3:ac:cb1:actoff", "zero3:ac:tile:actoff", "zero3:dir"]
LOW = ["zero3:bf16", "zero2:fp16"]
PACKED = ["zero3:packed", "ddp:packed"]
LORA = ["ddp:lora", "zero2:lora", "zero3:lora"]
LORA_BF16 = "zero3:lora:bf16"


@pytest.fixture(scope="module")
def results(fsdp2_runs, tmp_path_factory, micro_model_dir):
    refs, two = fsdp2_runs  # the 1- and 2-process launches (tests/conftest.py), shared with test_deepspeed.py
    two = dict(two)
    # HSDP: 2 groups of 2 processes, each group holding one sharded copy (global batch 8 as above).
    two["_four"] = worker_results(tmp_path_factory.mktemp("parity") / "four", 4, 1,
                                  ["hsdp:s2", "hsdp:s2:qlora", "hsdp:s2:lora:local"],
                                  {"SHARDTUNE_TEST_MODEL_DIR": str(micro_model_dir)})  # LoRA's adapter check
    two["_ref_packed"] = refs["ddp:packed"]
    two["_ref_lora"] = refs["ddp:lora"]
    two["_ref_qlora"] = refs["ddp:qlora"]
    two["_one_zero3_qlora"] = refs["zero3:qlora"]
    two["_ref_adamw8bit"] = refs["ddp:adamw8bit"]
    two["_ref_full"] = refs["ddp"]
    two["_ref_noclip"] = refs["ddp:noclip"]
    two["_one_mb8"] = refs["ddp:mb8"]
    two["_one_compile"] = refs["zero3:compile:aot"]
    two["_one_lora_local"] = refs["zero3:lora:local"]
    return refs["ddp"], two


@pytest.mark.parametrize("variant", FP32)
def test_fp32_trajectory_matches_unsharded(results, variant):
    ref, two = results
    assert two[variant]["world"] == 2 and ref["world"] == 1
    assert_same_gradients(ref, two[variant])
    assert ref["losses"][-1] < ref["losses"][0]  # it trains


def test_the_activation_offload_moved_the_ranks_activations(results):
    """The offload variants' parity above is not the offload idling: rank 0 moved its saved activations to the host
    (the block inputs under the checkpoint; what the budget keeps of each compiled block, more; under
    parallel.checkpoint_blocks=1 the first block's input only, fewer than both blocks' inputs)."""
    _, two = results
    checkpointed, budget, first = (two[v]["offloaded_bytes"] for v in ("zero3:ac:actoff", "zero3:compile:budget:actoff",
                                                                        "zero3:ac:cb1:actoff"))
    assert 0 < checkpointed < budget
    assert 0 < first < checkpointed  # without the pause, the second block's activations would go too


def test_hsdp_matches_unsharded_and_shards_within_groups(results):
    ref, two = results
    run = two["_four"]["hsdp:s2"]
    assert run["world"] == 4
    assert_same_gradients(ref, run)
    rep = run["sharding"]
    assert rep["all_dtensor"] and rep["mesh"] == ["(2, 2)"]
    assert rep["placements"] == ["(Replicate(), Shard(dim=0))"]
    assert rep["local_fraction"] == pytest.approx(0.5, abs=0.02)  # a half per rank: sharded over 2, not 4
    assert run["export_logit_diff"] < 1e-5


def test_qlora_under_hsdp_matches_single_process_qlora(results):
    # The NF4 weights are sharded over each group's 2 ranks (NF4's all-gather on the shard dimension)
    # and quantised with the whole weight's statistics, so the 1-process QLoRA trajectory is kept.
    two = results[1]
    run = two["_four"]["hsdp:s2:qlora"]
    assert_same_gradients(two["_ref_qlora"], run)
    assert run["nf4_params"] == PROJECTIONS * LAYERS  # the frozen projections are NF4 on every rank (their shards)
    assert run["adapter_tensors"] == 2 * PROJECTIONS * LAYERS and run["adapter_nonzero_b"] == PROJECTIONS * LAYERS


@pytest.mark.parametrize("variant", LOW)
def test_mixed_precision_close_to_fp32(results, variant):
    ref, two = results
    assert max_diff(ref["losses"], two[variant]["losses"]) < 2e-2


@pytest.mark.parametrize("variant", ["zero2", "zero3", "zero3:ac", "zero3:compile"])
def test_parameters_are_sharded(results, variant):
    report = results[1][variant]["sharding"]
    assert report["all_dtensor"] and report["all_shard0"]
    assert report["local_fraction"] == pytest.approx(0.5, abs=0.01)  # each of 2 ranks holds half


def test_ddp_is_not_sharded(results):
    assert not results[1]["ddp"]["sharding"]["all_dtensor"]


@pytest.mark.parametrize("variant", FP32)
def test_exported_model_reloads_with_same_logits(results, variant):
    assert results[1][variant]["export_logit_diff"] < 1e-5


def test_reference_export_reloads(results):
    assert results[0]["export_logit_diff"] < 1e-5


def test_sharded_safetensors_dir_loads_the_same_weights_as_the_preset(results):
    two = results[1]
    assert two["zero3:dir"]["losses"] == two["zero3"]["losses"]


def test_each_rank_reads_only_its_rows_of_each_tensor(results, micro_model_dir):
    # README (Models): "each rank reads only its own rows of each tensor straight from the safetensors files".
    # The worker counts the bytes of the rows the weight source returned to each rank (tests/dist/worker.py LoadProbe).
    from safetensors import safe_open

    whole = 0
    for file in micro_model_dir.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            whole += sum(f.get_tensor(name).nbytes for name in f.keys())  # noqa: SIM118 - not a dict
    loads = results[1]["zero3:dir"]["load"]
    assert len(loads) == 2
    assert sum(load["bytes_read"] for load in loads) == whole  # every row read once, by one rank
    for load in loads:
        assert load["bytes_read"] == pytest.approx(whole / 2, rel=0.01)  # its half, not the whole file


@pytest.mark.parametrize("variant", PACKED)
def test_packed_trajectory_matches_unsharded_packed(results, variant):
    # Packed rows (document mask, positions restarting per example) through every strategy:
    # the same global batches as the 1-process run give the same losses.
    two = results[1]
    assert_same_gradients(two["_ref_packed"], two[variant])
    assert two[variant]["export_logit_diff"] < 1e-5


@pytest.mark.parametrize("variant", LORA)
def test_lora_matches_single_process_lora_and_saves_a_loadable_adapter(results, variant):
    two = results[1]
    ref = two["_ref_lora"]
    assert_same_gradients(ref, two[variant])
    assert ref["losses"][-1] < ref["losses"][0]
    assert two[variant]["base_weights_diff"] == 0.0  # the base never changes, to the bit
    assert two[variant]["adapter_logit_diff"] < 1e-5  # PeftModel.from_pretrained(base, adapter) = trained


def test_lora_bf16_stores_the_frozen_base_in_bf16_and_tracks_fp32_lora(results):
    # peft.base_dtype=auto: under bf16 the frozen base is stored in bf16 (half the memory; every matmul
    # ran in bf16 anyway), the adapters keep fp32 masters; the trajectory stays near fp32 LoRA.
    two = results[1]
    run = two[LORA_BF16]
    assert run["dtypes"] == {"trainable": ["float32"], "frozen": ["bfloat16"]}
    assert two["zero3:lora"]["dtypes"] == {"trainable": ["float32"], "frozen": ["float32"]}
    assert run["base_weights_diff"] == 0.0  # the bf16 base equals the bf16-rounded initial weights
    assert max_diff(two["_ref_lora"]["losses"], run["losses"]) < 2e-2
    assert run["losses"][-1] < run["losses"][0]


def test_qlora_zero3_matches_single_process_qlora(results):
    # NF4 codes are the same however the weight is sharded (quantised with the whole weight's mean),
    # so sharded QLoRA follows the one-process QLoRA trajectory; close to bf16-free LoRA too.
    two = results[1]
    assert_same_gradients(two["_ref_qlora"], two["zero3:qlora"])
    assert max_diff(two["_ref_lora"]["losses"], two["zero3:qlora"]["losses"]) < 3e-2
    assert two["zero3:qlora"]["adapter_tensors"] == 2 * PROJECTIONS * LAYERS  # A and B of every adapted projection
    assert two["zero3:qlora"]["adapter_nonzero_b"] == PROJECTIONS * LAYERS  # every B trained away from its zero init


def test_qlora_on_one_process_through_fsdp2_matches_ddp(results):
    # One process: FSDP2 ignores the NF4 weights (nothing to shard) and does the mixed precision of
    # the rest; same trajectory as the DDP path, and every trainable parameter is an FSDP2 DTensor.
    two = results[1]
    one = two["_one_zero3_qlora"]
    assert one["world"] == 1
    assert_same_gradients(two["_ref_qlora"], one)
    assert one["adapter_tensors"] == 2 * PROJECTIONS * LAYERS and one["adapter_nonzero_b"] == PROJECTIONS * LAYERS


def test_frozen_weights_outside_fsdp2_train_as_inside(results):
    """parallel.shard_frozen=false: the frozen base stays whole on every rank, outside FSDP2 (plain tensors; the
    adapters are its DTensors), and training is the single-process LoRA run's to the gradient, on 1 and 2
    processes; the saved adapter loads in PEFT. In bf16 the base is the FSDP2-managed bf16 run's; QLoRA on 2
    processes keeps its NF4 weights with FSDP2 (sharded) and the rest of its frozen weights out; HSDP on 4 processes
    (2 groups of 2) trains the same."""
    two = results[1]
    for run in (two["zero3:lora:local"], two["_one_lora_local"]):
        assert_same_gradients(two["_ref_lora"], run)
        rep = run["sharding"]
        assert rep["frozen"] > 0 and rep["frozen_dtensors"] == 0 and rep["trainable_dtensors"] == rep["trainable"]
        assert run["base_weights_diff"] == 0.0 and run["adapter_logit_diff"] < 1e-5
    bf16 = two["zero3:lora:bf16:local"]
    assert bf16["dtypes"]["frozen"] == ["bfloat16"] and bf16["sharding"]["frozen_dtensors"] == 0
    assert max_diff(two["zero3:lora:bf16"]["losses"], bf16["losses"]) < 1e-6
    hsdp = two["_four"]["hsdp:s2:lora:local"]  # a (replicate, shard) mesh: the same, adapters on both dims
    assert_same_gradients(two["_ref_lora"], hsdp)
    assert hsdp["sharding"]["frozen_dtensors"] == 0 and hsdp["sharding"]["mesh"] == ["(2, 2)"]
    qlora = two["zero3:qlora:local"]
    assert_same_gradients(two["_ref_qlora"], qlora)
    assert 0 < qlora["sharding"]["frozen_dtensors"] == qlora["nf4_params"] < qlora["sharding"]["frozen"]
    # The default, parallel.shard_frozen: auto, keeps them whole on one process and sharded on two.
    one, sharded = two["_one_zero3_qlora"]["sharding"], two["zero3:qlora"]["sharding"]
    assert one["frozen"] > 0 and one["frozen_dtensors"] == 0
    assert sharded["frozen_dtensors"] == sharded["frozen"] > 0


def test_adamw8bit_sharded_close_to_unsharded_and_to_adamw(results):
    two = results[1]
    assert max_diff(two["_ref_adamw8bit"]["losses"], two["zero3:adamw8bit"]["losses"]) < 2e-2
    assert max_diff(two["_ref_full"]["losses"], two["zero3:adamw8bit"]["losses"]) < 5e-2


# --- Gradients: a scale error the clipped runs cannot see -------------------------------------------------------
STEPS, ACCUM = 6, 2  # tests/dist/worker.py's steps; the 2-process accumulation


def test_without_clipping_a_higher_lr_run_keeps_the_gradients(results):
    # optim.max_grad_norm=0 and lr 1e-2: nothing rescales the gradients before the update.
    two = results[1]
    ref, run = two["_ref_noclip"], two["zero3:noclip"]
    # Unclipped steps at lr 1e-2 amplify summation-order rounding: 2.6e-5 apart by step 3 (measured). A scale
    # error is a factor (2 for a lost `* world`), so 1e-4 still sees it.
    assert_same_gradients(ref, run, rtol=1e-4)
    assert max(ref["grad_norms"]) > 1.0  # clipping at 1.0 would have changed these steps
    assert max_diff(two["_ref_full"]["losses"], ref["losses"]) > 1e-2  # clipping is really off / the LR higher
    assert ref["losses"][-1] < ref["losses"][0]


def test_any_split_of_the_global_batch_gives_the_same_gradients(results):
    # Variable-length rows (target tokens differ per micro-batch): 1 process x micro-batch 8 x accumulation 1,
    # 2 x 1 x 4 (one sequence per micro-batch) and the reference 1 x 2 x 4 see the same 8 sequences per step. A
    # per-micro-batch mean, or a normaliser that is not the step's global target-token count, weighs them differently.
    ref, two = results
    one, split = two["_one_mb8"], two["zero3:mb1"]
    assert one["world"] == 1 and split["world"] == 2
    assert one["mlp_calls"] == LAYERS * STEPS * 1 and split["mlp_calls"] == LAYERS * STEPS * 4  # the split ran
    assert_same_gradients(one, split)
    assert_same_gradients(ref, split)


# --- Each run that claims a feature proves it was on ------------------------------------------------------------
def test_activation_checkpointing_recomputes_every_block(results):
    two = results[1]
    assert two["zero3"]["mlp_calls"] == LAYERS * STEPS * ACCUM  # one forward per block per micro-batch
    assert two["zero3:ac"]["mlp_calls"] == 2 * LAYERS * STEPS * ACCUM  # and the recompute in the backward
    assert LAYERS > 1 and two["zero3:ac:cb1"]["mlp_calls"] == (LAYERS + 1) * STEPS * ACCUM  # the first block's only


def test_compile_produces_compiled_graphs(results):
    ref, two = results
    assert two["zero3:compile"]["compiled_graphs"] > 0 and two["_one_compile"]["compiled_graphs"] > 0
    # under checkpointing too, around and inside (transformers 5.25's own checkpoint had left every block eager)
    assert two["zero3:ac:compile"]["compiled_graphs"] > 0 and two["zero3:ac:compile:around"]["compiled_graphs"] > 0
    assert two["zero3:compile:budget"]["compiled_graphs"] > 0
    assert two["zero3"]["compiled_graphs"] == 0
    # compiled on one process too: traced and partitioned as on two (aot_eager: Inductor's cold start, ~45 s of C++ on
    # CI's 2 cores, is paid once, by the two-process zero3:compile)
    assert_same_gradients(ref, two["_one_compile"])


def test_compiled_qlora_blocks_under_zero3_train_as_eager_with_one_graph_for_every_block(results):
    """Compiled QLoRA blocks with the checkpoint inside, sharded over two processes: the eager run's trajectory,
    and as many graphs as full fine-tuning compiles (one for every block in training, one for evaluation's no_grad
    forward). The frozen embedding's output is made to need a gradient (parallel/prepare.py
    one_graph_for_every_block) on FSDP2's sharded embedding too; without it block 0 compiles a graph of its own.
    Traced and partitioned by Dynamo and AOTAutograd as on a GPU, run with eager kernels (`aot`: Inductor's NF4 code
    on CPU is tests/unit/test_nf4_linear.py's)."""
    two = results[1]
    compiled = two["zero3:qlora:ac:compile:aot"]
    assert_same_gradients(two["zero3:qlora"], compiled)
    assert compiled["nf4_params"] == PROJECTIONS * LAYERS
    assert compiled["compiled_graphs"] == two["zero3:compile"]["compiled_graphs"] == 2


@pytest.mark.parametrize(("variant", "dtype"), [("zero3", "float32"), ("zero3:bf16", "bfloat16"),
                                                ("zero2:fp16", "float16"), (LORA_BF16, "bfloat16")])
def test_blocks_compute_in_the_claimed_precision(results, variant, dtype):
    assert results[1][variant]["activation_dtypes"] == [dtype]


def test_packed_runs_carry_document_masks(results):
    two = results[1]
    for variant in PACKED:
        assert two[variant]["doc_masked_calls"] == STEPS * ACCUM  # every training forward of this rank
    assert two["_ref_packed"]["doc_masked_calls"] == STEPS * 4
    assert two["zero3"]["doc_masked_calls"] == 0


@pytest.mark.parametrize("variant", ["zero3:qlora", "_one_zero3_qlora", "_ref_qlora"])
def test_qlora_runs_hold_nf4_weights(results, variant):
    assert results[1][variant]["nf4_params"] == PROJECTIONS * LAYERS
    assert results[1]["zero3:lora"]["nf4_params"] == 0


@pytest.mark.parametrize("variant", ["zero3:adamw8bit", "_ref_adamw8bit"])
def test_adamw8bit_keeps_8bit_states(results, variant):
    assert "OptimState8bit" in results[1][variant]["optimizer_state_types"]
    assert "OptimState8bit" not in results[1]["zero3"]["optimizer_state_types"]
