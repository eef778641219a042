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
