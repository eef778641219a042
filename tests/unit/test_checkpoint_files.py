"""Checkpoint files without processes: safe loading, manifests, completeness, resolution, pruning."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardtune.checkpoint.dcp_files import load_state
from shardtune.checkpoint.layout import complete_checkpoints, finalize, is_complete, resolve_checkpoint, verify
from shardtune.errors import ShardtuneError


def _save(path: Path, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _load(path: Path, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        load_state(state, path, no_dist=True)


class Exploit:
    """Unpickling this runs a command (what an attacker would put in a checkpoint)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _step(root: Path, step: int, state: dict) -> Path:
    tmp = root / f".step-{step:08d}.tmp"
    _save(tmp, state)
    final = root / f"step-{step:08d}"
    finalize(tmp, final, {"step": step, "world_size": 1})
    return final


def test_plain_checkpoint_round_trips_through_the_safe_reader(tmp_path):
    state = {"model": {"w": torch.randn(3, 4)}, "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}}
    _save(tmp_path / "c", state)
    target = {"model": {"w": torch.zeros(3, 4)}, "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}}
    _load(tmp_path / "c", target)
    assert torch.equal(target["model"]["w"], state["model"]["w"])
    assert target["optim"]["param_groups"][0]["lr"] == 0.1


def test_code_in_a_checkpoint_entry_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    _save(tmp_path / "c", {"w": torch.ones(2), "extra": Exploit(marker)})
    with pytest.raises(ShardtuneError, match="not plain data"):
        _load(tmp_path / "c", {"w": torch.zeros(2), "extra": None})
    assert not marker.exists()


def test_code_in_the_metadata_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    _save(tmp_path / "c", {"w": torch.ones(2)})
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(Exploit(marker)))
    with pytest.raises(ShardtuneError, match=r"posix\.system|os\.system"):
        _load(tmp_path / "c", {"w": torch.zeros(2)})
    assert not marker.exists()


def test_manifest_completeness_and_damage(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    first = _step(root, 1, {"w": torch.ones(4)})
    second = _step(root, 2, {"w": torch.full((4,), 2.0)})
    manifest = json.loads((second / "manifest.json").read_text())
    assert manifest["step"] == 2 and ".metadata" in manifest["files"]
    assert complete_checkpoints(root) == [first, second]
    (root / ".step-00000003.tmp").mkdir()  # a save cut short: ignored
    (root / "step-00000004").mkdir()  # no manifest: ignored
    assert resolve_checkpoint("auto", root) == second
    verify(second)
    distcp = next(second.glob("*.distcp"))
    data = bytearray(distcp.read_bytes())
    data[-1] ^= 0xFF  # same size, one bit flipped: only the checksum sees it
    distcp.write_bytes(bytes(data))
    assert is_complete(second)
    with pytest.raises(ShardtuneError, match="does not match the manifest"):
        verify(second)
    distcp.write_bytes(bytes(data[:-1]))  # truncated: no longer complete
    assert not is_complete(second) and resolve_checkpoint("auto", root) == first


def test_resolve_paths(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    assert resolve_checkpoint("auto", root) is None
    step = _step(root, 7, {"w": torch.ones(1)})
    assert resolve_checkpoint(str(step)) == step
    assert resolve_checkpoint(str(tmp_path / "run")) == step  # a run directory: its newest
    with pytest.raises(ShardtuneError, match="no complete checkpoint there"):
        resolve_checkpoint(str(tmp_path / "missing"))


def test_the_async_stager_keeps_its_host_buffers_from_one_save_to_the_next():
    """torch 2.11 clears a DefaultStager's buffer cache after each staging (pytorch #183413): reused, it
    fails the next save; replaced, it allocates (on GPUs: pins) the whole state again for every save.
    The checkpointer's stager survives that close: the second staging copies into the first one's
    buffers, and a reused stager still stages anything a state dict holds."""
    from shardtune.checkpoint.dcp_files import kept_stager

    stager = kept_stager(gpu=False)
    assert stager is not None, "this torch has DCP's DefaultStager; the checkpointer must get a stager"
    weight = torch.arange(4.0)
    try:
        first = stager.stage({"w": weight}).result()
        stager._state_dict_stager.close()  # what torch 2.11 does at the end of every staging
        stager.close()  # and what async_save may do with the caller's stager
        weight.add_(10)
        second = stager.stage({"w": weight, "cls": {"kind": type}}).result()
        assert torch.equal(second["w"], weight) and second["cls"]["kind"] is type
        assert second["w"].data_ptr() == first["w"].data_ptr()  # the same host buffer, refreshed
        assert second["w"].data_ptr() != weight.data_ptr()  # a copy, not the live tensor
    finally:
        stager.release()
    assert not stager._state_dict_stager._cached_storage_mapping  # released: the buffers can be freed


def test_the_dcp_writer_puts_the_checkpoint_in_place_when_dcp_finishes(tmp_path):
    """The manifest and the rename happen in DCP's finish, where a writer process runs them."""
    from shardtune.checkpoint.dcp_files import ManifestWriter

    tmp, final = tmp_path / ".step-00000003.tmp", tmp_path / "step-00000003"
    writer = ManifestWriter(tmp, final, {"step": 3, "world_size": 1, "format": "dcp"})
    writer = pickle.loads(pickle.dumps(writer))  # as it travels to a writer process
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.arange(6.0)}, storage_writer=writer, no_dist=True)
    assert not tmp.exists() and is_complete(final)
    verify(final)
    assert {".metadata", "__0_0.distcp"} <= set(json.loads((final / "manifest.json").read_text())["files"])
    state = {"w": torch.zeros(6)}
    _load(final, state)
    assert torch.equal(state["w"], torch.arange(6.0))


def test_the_stager_for_a_writer_process_stages_into_shared_memory():
    from shardtune.checkpoint.dcp_files import kept_stager

    stager = kept_stager(gpu=False, shared=True)
    try:
        staged = stager.stage({"w": torch.arange(4.0)}).result()
        assert staged["w"].is_shared() and torch.equal(staged["w"], torch.arange(4.0))
    finally:
        stager.release()


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_checked_resolution_refuses_a_damaged_checkpoint_by_name_and_auto_falls_back(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    root.mkdir()
    first = _step(root, 1, {"w": torch.ones(4)})
    second = _step(root, 2, {"w": torch.full((4,), 2.0)})
    distcp = next(second.glob("*.distcp"))
    _flip_last_byte(distcp)
    assert resolve_checkpoint("auto", root) == second  # sizes alone cannot see it
    with pytest.raises(ShardtuneError, match=rf"{second} is damaged: {distcp.name} does not match.*checksum"):
        resolve_checkpoint(str(second), check=True)
    capsys.readouterr()
    assert resolve_checkpoint("auto", root, check=True) == first
    assert resolve_checkpoint(str(tmp_path), check=True) == first  # a run directory too
    err = capsys.readouterr().err
    assert f"{distcp.name} does not match" in err and f"falling back to the previous checkpoint {first}" in err
    _flip_last_byte(next(first.glob("*.distcp")))
    with pytest.raises(ShardtuneError, match="no earlier intact checkpoint to fall back to"):
        resolve_checkpoint("auto", root, check=True)


def test_a_truncated_file_is_refused_by_name_even_without_reading_checksums(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    root.mkdir()
    first = _step(root, 1, {"w": torch.ones(4)})
    second = _step(root, 2, {"w": torch.full((4,), 2.0)})
    distcp = next(second.glob("*.distcp"))
    distcp.write_bytes(distcp.read_bytes()[:-3])
    for check in (False, True):
        with pytest.raises(ShardtuneError, match=rf"{distcp.name} does not match the manifest \([\d,]+ bytes, the "
                                                 r"manifest says [\d,]+: truncated"):
            resolve_checkpoint(str(second), check=check)
        capsys.readouterr()
        assert resolve_checkpoint("auto", root, check=check) == first
        assert f"{distcp.name} does not match" in capsys.readouterr().err  # said, not skipped silently


def test_manifests_with_crc32_only_are_still_verified(tmp_path):
    """Checkpoints written before xxh3 (or where xxhash is missing) carry CRC32; verify checks it."""
    import zlib

    step = _step(tmp_path, 1, {"w": torch.ones(4)})
    manifest = json.loads((step / "manifest.json").read_text())
    assert all("xxh3_64" in info for info in manifest["files"].values())
    for rel, info in manifest["files"].items():
        del info["xxh3_64"]
        info["crc32"] = zlib.crc32((step / rel).read_bytes())
    (step / "manifest.json").write_text(json.dumps(manifest))
    verify(step)
    _flip_last_byte(next(step.glob("*.distcp")))
    with pytest.raises(ShardtuneError, match="crc32 checksum differs"):
        verify(step)


def test_finalize_takes_each_ranks_own_checksums_and_reads_only_the_rest(tmp_path):
    """Rank 1's record (record_own, written where rank 1 wrote the file) goes into the manifest as it is: rank 0
    does not read that file. A file no rank recorded, or whose size changed since its record, rank 0 reads."""
    from shardtune.checkpoint.layout import SUMS_DIR, record_own

    tmp = tmp_path / ".step-00000001.tmp"
    (tmp / "rng").mkdir(parents=True)
    for name, data in [("rng/rank1.bin", b"one"), ("__1_0.distcp", b"shard-of-rank-1"), ("trainer_state.json", b"{}"),
                       ("__1_1.distcp", b"x")]:
        (tmp / name).write_bytes(data)
    record_own(tmp, [tmp / "rng" / "rank1.bin", tmp / "__1_0.distcp", tmp / "__1_1.distcp"], 1, "dcp")
    record = json.loads((tmp / SUMS_DIR / "dcp-rank1.json").read_text())
    key = next(k for k in record["__1_0.distcp"] if k != "size" and k != "by")
    # Rank 1 says so: a value no file could hash to shows whether rank 0 took the record or read the file.
    record["__1_0.distcp"][key] = "from-rank-1" if key == "xxh3_64" else 7
    (tmp / SUMS_DIR / "dcp-rank1.json").write_text(json.dumps(record))
    (tmp / "__1_1.distcp").write_bytes(b"grown since")  # its record's size no longer matches: read again
    final = tmp_path / "step-00000001"
    finalize(tmp, final, {"step": 1, "world_size": 2})
    files = json.loads((final / "manifest.json").read_text())["files"]
    assert set(files) == {"rng/rank1.bin", "__1_0.distcp", "trainer_state.json", "__1_1.distcp"}  # no .sums
    assert files["__1_0.distcp"][key] == record["__1_0.distcp"][key] and files["__1_0.distcp"]["by"] == 1
    assert files["rng/rank1.bin"]["by"] == 1
    assert files["trainer_state.json"]["by"] == 0
    assert files["__1_1.distcp"]["by"] == 0 and files["__1_1.distcp"]["size"] == len(b"grown since")
    assert not (final / SUMS_DIR).exists()
