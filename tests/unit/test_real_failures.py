"""Real failures (not typos) end with exit code 2 and one line naming the problem, no traceback; --debug shows it.
One table, each case a broken thing on disk, run through `shardtune validate` in this process."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.yaml")


def _file_as_output(tmp: Path, model: Path) -> list[str]:
    (tmp / "a_file").write_text("x")
    return [f"train.output_dir={tmp / 'a_file'}"]


def _output_under_a_file(tmp: Path, model: Path) -> list[str]:
    (tmp / "a_file").write_text("x")
    return [f"train.output_dir={tmp / 'a_file' / 'run'}"]


def _truncated_weights(tmp: Path, model: Path) -> list[str]:
    f = model / "model.safetensors"
    with f.open("r+b") as handle:
        handle.truncate(f.stat().st_size - 1000)
    return [f"model.path={model}"]


def _garbage_weights(tmp: Path, model: Path) -> list[str]:
    (model / "model.safetensors").write_bytes(b"not a safetensors file at all")
    return [f"model.path={model}"]


def _corrupt_header(tmp: Path, model: Path) -> list[str]:
    f = model / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"\x00\x01\x02\x03"  # the JSON header no longer parses
    f.write_bytes(bytes(data))
    return [f"model.path={model}"]


CASES: dict[str, tuple[Callable[[Path, Path], list[str]], str]] = {
    "output dir is a file": (_file_as_output, r"is a file, not a folder"),
    "output dir under a file": (_output_under_a_file, r"cannot create .*is a file"),
    "truncated safetensors": (_truncated_weights, r"model\.safetensors' is truncated or corrupt"),
    "not a safetensors file": (_garbage_weights, r"model\.safetensors' is not a valid safetensors file"),
    "corrupt safetensors header": (_corrupt_header, r"model\.safetensors' is not a valid safetensors file"),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shardtune.models.init_model import init_model

    return init_model(tmp_path_factory.mktemp("m") / "tiny", "tiny-llama")


@pytest.mark.parametrize("case", CASES)
def test_real_failure_is_one_line_exit_2(tmp_path, model_dir, cli, case):
    import shutil

    make, says = CASES[case]
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    args = ["validate", TINY, "model.preset=null", f"model.path={model}", f"train.output_dir={tmp_path / 'out'}",
            f"data.train_file={ROOT / 'examples' / 'data' / 'tasks.jsonl'}", *make(tmp_path, model)]
    res = cli(*args)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert re.search(says, lines[0]), lines[0]
    debug = cli(*args, "--debug")
    assert debug.returncode == 2 and "Traceback" in debug.stderr and lines[0] in debug.stderr
