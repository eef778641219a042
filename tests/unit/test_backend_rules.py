"""What each backend runs, declared in its own module (parallel.BACKENDS), and the refusals `validate` makes
before any process starts: unsupported settings, the machine, and resuming a checkpoint of another format."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from shardtune.checkpoint.layout import finalize
from shardtune.config import Config, config_from_dict
from shardtune.errors import ShardtuneError
from shardtune.parallel import BACKENDS, describe
from shardtune.parallel.fsdp2 import hsdp_shard_size
from shardtune.parallel.spec import SUPPORT_KEYS
from shardtune.validate import check_combination, check_resume

BASE = {"model": {"preset": "tiny-llama"}, "data": {"train_file": "examples/data/tasks.jsonl"}}


def _cfg(*overrides: str) -> Config:
    return config_from_dict(BASE, list(overrides))


def _allowed(key: str) -> set[str]:
    """The values the config accepts for `section.field` (its Literal; `auto` asks the planner, which picks
    among what the backends support)."""
    section, name = key.split(".")
    model = type(getattr(_cfg(), section))
    annotation = model.model_fields[name].annotation
    if annotation is bool or bool in typing.get_args(annotation):  # SUPPORT_KEYS reads a switch as "true" / "false"
        return {"false", "true"}
    if typing.get_args(annotation) == (int, type(None)):  # a number or unset (parallel.tiled_mlp): set or not
        return {"false", "true"}
    # a Literal with False in it (train.float8: false | tensorwise | rowwise) reads its False as "false"
    return {"false" if v is False else v for v in typing.get_args(annotation)} - {"auto"}


def test_backends_are_the_config_choices():
    assert set(BACKENDS) == _allowed("parallel.backend")


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_unsupported_value_has_a_refusal_and_every_refusal_a_value(backend):
    spec = BACKENDS[backend]
    assert set(spec.supports) == set(SUPPORT_KEYS)
    for key, supported in spec.supports.items():
        assert set(supported) <= _allowed(key), key
    unsupported = {(key, value) for key in SUPPORT_KEYS for value in _allowed(key) - set(spec.supports[key])}
    assert set(spec.refusals) == unsupported


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_each_refusal_is_what_check_combination_raises(backend):
    for (key, value), message in BACKENDS[backend].refusals.items():
        with pytest.raises(ShardtuneError) as info:
            check_combination(_cfg(f"parallel.backend={backend}", f"{key}={value}"))
        assert str(info.value) == message and "\n" not in message


def test_deepspeed_fp16_is_refused_on_a_cpu_machine_only():
    cfg = _cfg("parallel.backend=deepspeed", "parallel.strategy=zero2", "train.precision=fp16")
    with pytest.raises(ShardtuneError, match="DeepSpeed has no fp16 on CPU"):
        check_combination(cfg, 2, device="cpu")
    check_combination(cfg, 2, device="cuda")
    check_combination(cfg, 2)  # a machine not known (a planner's candidate): not refused
    check_combination(_cfg("train.precision=fp16", "parallel.strategy=zero2"), 2, device="cpu")  # fsdp2 has it


def test_deepspeed_refuses_applying_non_finite_updates_above_stage_0():
    """DeepSpeed's ZeRO optimizers skip a non-finite step whatever the setting: skip_nonfinite=false is refused there
    (one line); stage 0 (ddp) and FSDP2 honour it."""
    for strategy in ("zero1", "zero2", "zero3"):
        with pytest.raises(ShardtuneError) as info:
            check_combination(_cfg("parallel.backend=deepspeed", f"parallel.strategy={strategy}",
                                   "train.skip_nonfinite=false"))
        assert str(info.value).startswith(f"train.skip_nonfinite: false, but DeepSpeed's ZeRO optimizer "
                                          f"(parallel.strategy={strategy}) always skips")
    check_combination(_cfg("parallel.backend=deepspeed", "parallel.strategy=ddp", "train.skip_nonfinite=false"))
    check_combination(_cfg("parallel.strategy=zero2", "train.skip_nonfinite=false"))
    check_combination(_cfg("parallel.backend=deepspeed", "parallel.strategy=zero2"))


def test_describe_comes_from_the_backend():
    assert describe(_cfg("parallel.backend=deepspeed", "parallel.strategy=zero1"), 2) == "DeepSpeed ZeRO stage 1"
    assert describe(_cfg("parallel.strategy=ddp"), 2) == "torch DDP (replicated)"
    assert "reshard_after_forward=False" in describe(_cfg("parallel.strategy=zero2"), 2)
    assert "(replicate 2, shard 2)" in describe(_cfg("parallel.strategy=hsdp", "parallel.shard_size=2"), 4)


@pytest.mark.parametrize("world, per_node", [(4, 2), (16, 8)])
def test_hsdp_auto_group_is_the_processes_of_one_node(world, per_node):
    assert hsdp_shard_size(_cfg("parallel.strategy=hsdp").parallel, world, per_node) == per_node
    assert f"(replicate {world // per_node}, shard {per_node})" in describe(_cfg("parallel.strategy=hsdp"), per_node,
                                                                           nnodes=world // per_node)


def test_hsdp_group_is_checked_against_the_processes_of_every_node():
    """shard_size 4 on 2 nodes of 2 processes: one group across both nodes; on one node of 2 it cannot be."""
    spanning = _cfg("parallel.strategy=hsdp", "parallel.shard_size=4")
    check_combination(spanning, 2, nnodes=2)
    assert "(replicate 1, shard 4)" in describe(spanning, 2, nnodes=2)
    with pytest.raises(ShardtuneError, match="shard_size: 4 does not divide the 2 processes"):
        check_combination(spanning, 2)
    for size, nnodes in (("3", 2), ("8", 2), ("4", 3)):
        with pytest.raises(ShardtuneError) as info:
            check_combination(_cfg("parallel.strategy=hsdp", f"parallel.shard_size={size}"), 2, nnodes=nnodes)
        assert str(info.value).startswith(f"parallel.shard_size: {size} does not divide the {2 * nnodes} processes")
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("shard_size, mesh", [("auto", (2, 2)), ("4", (1, 4)), ("2", (2, 2))])
def test_engine_mesh_takes_the_group_over_every_node(monkeypatch, shard_size, mesh):
    """The run's mesh (fsdp2_engine) from the job's 4 processes, 2 per node (LOCAL_WORLD_SIZE): what validate
    accepted for 2 nodes is what the engine builds."""
    from types import SimpleNamespace

    from shardtune.parallel import fsdp2_engine

    monkeypatch.setattr(fsdp2_engine, "init_device_mesh", lambda device, shape, mesh_dim_names: shape)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = _cfg("parallel.strategy=hsdp", f"parallel.shard_size={shard_size}")
    check_combination(cfg, 2, nnodes=2)
    engine = SimpleNamespace(parallel=cfg.parallel, ctx=SimpleNamespace(world=4, device=SimpleNamespace(type="cpu")))
    assert fsdp2_engine.FSDP2Backend._mesh(engine) == mesh


def test_a_backend_checks_the_whole_job_not_one_node():
    """One process on each of 2 nodes is 2 processes: FSDP2 shards the frozen base there (shard_frozen auto), so a
    float8 base that must stay whole is refused as on one node of 2; DeepSpeed's batch is built for both nodes."""
    float8_base = _cfg("train.precision=bf16", "train.float8=tensorwise", "peft.method=lora", "peft.base_dtype=float8",
                       "parallel.strategy=zero3")
    check_combination(float8_base, 1)
    for world, nnodes in ((2, 1), (1, 2)):
        with pytest.raises(ShardtuneError, match=r"peft\.base_dtype: float8"):
            check_combination(float8_base, world, nnodes=nnodes)
    pytest.importorskip("deepspeed")
    ds = _cfg("parallel.backend=deepspeed", "parallel.strategy=zero2", "train.micro_batch_size=2", "train.grad_accum=3",
              "deepspeed.train_batch_size=12")  # 2 x 3 x 2 processes
    check_combination(ds, 1, nnodes=2)
    with pytest.raises(ShardtuneError, match="train_batch_size"):
        check_combination(ds, 1)


def _checkpoint(root: Path, fmt: str, world: int) -> Path:
    tmp = root / ".step-00000005.tmp"
    tmp.mkdir(parents=True)
    (tmp / "trainer_state.json").write_text("{}")
    final = root / "step-00000005"
    finalize(tmp, final, {"step": 5, "world_size": world, "format": fmt})
    return final


def test_resume_is_checked_before_any_process_starts(tmp_path):
    out = tmp_path / "run"
    _checkpoint(out / "checkpoints", "deepspeed", 2)
    run = ["parallel.backend=deepspeed", f"train.output_dir={out}", "checkpoint.resume=auto"]
    check_resume(_cfg(*run), 2)
    with pytest.raises(ShardtuneError) as info:
        check_resume(_cfg(*run), 1)
    assert "DeepSpeed checkpoint of 2 processes" in str(info.value) and "--nproc 2" in str(info.value)
    with pytest.raises(ShardtuneError, match="written by the deepspeed backend"):
        check_resume(_cfg(f"train.output_dir={out}", "checkpoint.resume=auto"), 2)

    dcp_run = tmp_path / "dcp"
    _checkpoint(dcp_run / "checkpoints", "dcp", 2)
    check_resume(_cfg(f"train.output_dir={dcp_run}", "checkpoint.resume=auto"), 3)  # DCP reshards
    with pytest.raises(ShardtuneError, match="written by the fsdp2 backend"):
        check_resume(_cfg("parallel.backend=deepspeed", f"train.output_dir={dcp_run}", "checkpoint.resume=auto"), 2)
    check_resume(_cfg(f"train.output_dir={tmp_path / 'none'}", "checkpoint.resume=auto"), 2)  # nothing: fresh
    with pytest.raises(ShardtuneError, match="no complete checkpoint there"):
        check_resume(_cfg(f"checkpoint.resume={tmp_path / 'missing'}"), 2)
