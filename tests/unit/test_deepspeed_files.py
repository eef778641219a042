"""DeepSpeed-format checkpoints: the pickle check (checkpoint/deepspeed_files.py) on planted files, no processes.
Real checkpoints, their export and resume are tested in tests/dist/test_deepspeed_checkpoints.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import Payload

from shardtune.checkpoint.deepspeed_files import check_pickles
from shardtune.errors import ShardtuneError


def _plant(folder: Path, marker: Path, **save_kwargs) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": Payload(marker), "w": torch.ones(3)}}, path, **save_kwargs)
    return path


def test_payload_is_live_when_unpickled_freely(tmp_path):
    """The planted file really runs code under DeepSpeed's torch.load(weights_only=False)."""
    marker = tmp_path / "ran"
    path = _plant(tmp_path / "state", marker)
    code = f"import torch; torch.load({str(path)!r}, weights_only=False)"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    assert marker.exists()


@pytest.mark.parametrize("kind", ["zip", "protocol4", "legacy"])
def test_check_pickles_refuses_a_planted_payload(tmp_path, kind):
    marker = tmp_path / "ran"
    kwargs = {"zip": {}, "protocol4": {"pickle_protocol": 4},
              "legacy": {"_use_new_zipfile_serialization": False}}[kind]
    path = _plant(tmp_path / "state", marker, **kwargs)
    with pytest.raises(ShardtuneError) as err:
        check_pickles(tmp_path / "state")
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    if kind == "zip":  # the scanner names the global; protocol 4 / legacy files cannot be scanned, so refused
        assert "posix.system" in message or "os.system" in message
    assert not marker.exists()


def test_check_pickles_refuses_an_empty_or_missing_folder(tmp_path):
    with pytest.raises(ShardtuneError, match="no DeepSpeed checkpoint"):
        check_pickles(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardtuneError, match="no DeepSpeed checkpoint files"):
        check_pickles(tmp_path / "empty")


def test_check_pickles_ignores_globals_other_libraries_registered(tmp_path):
    """add_safe_globals() by some library must not widen what a checkpoint may name."""
    marker = tmp_path / "ran"
    _plant(tmp_path / "state", marker)
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([os.system])
    try:
        with pytest.raises(ShardtuneError, match="system"):
            check_pickles(tmp_path / "state")
        assert os.system in torch.serialization.get_safe_globals()  # restored afterwards
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    assert not marker.exists()


def test_weights_only_loads_refuses_what_the_scan_lets_through(tmp_path):
    """A pickle naming only an allowed class, but BUILDing onto the class object itself (setattr on
    DeepSpeed's LossScaler under a full unpickler): the scan passes it, weights_only_loads refuses it."""
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    from shardtune.checkpoint.deepspeed_files import weights_only_loads

    folder = tmp_path / "state"
    folder.mkdir()
    path = folder / "mp_rank_00_model_states.pt"
    data = b"\x80\x02cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\nN}X\x05\x00\x00\x00pwnedK\x01s\x86b."
    writer = torch._C.PyTorchFileWriter(str(path))
    writer.write_record("data.pkl", data, len(data))
    writer.write_record("byteorder", b"little", 6)
    writer.write_end_of_file()
    del writer
    check_pickles(folder)  # names nothing but LossScaler
    code = (f"import torch; torch.load({str(path)!r}, weights_only=False); "
            "from deepspeed.runtime.fp16.loss_scaler import LossScaler; print(getattr(LossScaler, 'pwned', None))")
    freely = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert freely.stdout.strip().endswith("1")  # DeepSpeed's own read would patch the class

    def original(p, map_location=None):
        raise AssertionError("the checkpoint engine's own load ran")

    engine = SimpleNamespace(checkpoint_engine=SimpleNamespace(load=original))
    with weights_only_loads(engine), pytest.raises(Exception, match="Weights only load failed"):
        engine.checkpoint_engine.load(str(path), map_location="cpu")
    assert engine.checkpoint_engine.load is original
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    assert not hasattr(LossScaler, "pwned")
