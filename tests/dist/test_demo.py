"""End to end, as a user runs it: the README's demo command, torchrun directly, the Python API."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import ROOT, in_this_process, run, run_cli, shardtune

pytestmark = pytest.mark.dist

TINY = str(ROOT / "examples" / "tiny.yaml")
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "peak_mem_gib", "mfu"}


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_demo_trains_on_two_cpu_processes_and_learns(tmp_path):
    out = tmp_path / "tiny"
    proc = shardtune("train", TINY, "--output-dir", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "zero3 on 2 x cpu" in proc.stderr
    # Other libraries' noise before the first line (runtime.quiet_library_noise): torchao's CUDA kernels that a CPU
    # build of torch cannot load, torch's deprecation notice to torchao.
    assert "Enum subclass" not in proc.stderr
    assert torch.version.cuda is not None or "Failed to load" not in proc.stderr
    records = _records(out)
    steps = [r for r in records if not r.get("eval")]
    evals = [r for r in records if r.get("eval")]
    assert steps and all(r.keys() >= METRIC_KEYS for r in steps)
    assert steps[-1]["step"] == 200 and steps[-1]["mfu"] is None  # no MFU on a CPU
    assert all(r["tokens_per_sec"] > 0 and r["peak_mem_gib"] > 0 for r in steps)
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 200
    assert evals[-1]["eval_loss"] < 0.5 * evals[0]["eval_loss"]
    assert evals[-1]["eval_accuracy"] > evals[0]["eval_accuracy"] + 0.2
    assert (out / "config.yaml").is_file() and (out / "summary.json").is_file()
    assert (out / "report" / "report.html").is_file()  # on by default (the tests' in-process runs turn it off)
    # Every run is a calibration point: the prediction beside what was measured.
    plan = json.loads((out / "plan.json").read_text())["chosen"]
    assert (plan["strategy"], plan["micro_batch_size"]) == ("zero3", 16)
    compared = json.loads((out / "summary.json").read_text())["plan"]
    assert compared["measured"]["tokens_per_sec_per_gpu"] > 0 and "tokens_per_sec_per_gpu" in compared["error"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    ids = tokenizer("up abc=", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size


def test_started_by_torchrun_directly(tmp_path, data_cache):
    out = tmp_path / "direct"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "shardtune", "train", TINY, "train.max_steps=4", "log.every=2", f"train.output_dir={out}",
           "train.eval_batches=1", f"data.cache_dir={data_cache}", "log.report=false"]
    proc = run(cmd)
    # torchrun's own report ends stderr: show the workers' lines before it too
    assert proc.returncode == 0, proc.stderr[-8000:]
    assert [r["step"] for r in _records(out) if not r.get("eval")] == [2, 4]
    assert "2 x cpu" in proc.stderr


def test_python_api(tmp_path):
    import shardtune

    with in_this_process():  # the API is called from a user's own Python process
        s = shardtune.train(TINY, ["train.max_steps=3", "parallel.strategy=zero2", "train.eval_batches=1"], nproc=1,
                            output_dir=str(tmp_path / "api"))
    assert {"steps": s["steps"], "strategy": s["strategy"], "world": s["world_size"]} == {
        "steps": 3, "strategy": "zero2", "world": 1}
    cfg = shardtune.load_config(tmp_path / "api" / "config.yaml")
    assert cfg.parallel.strategy == "zero2" and cfg.train.max_steps == 3


def test_bad_row_with_strict_data_exits_2_with_one_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    rows = (ROOT / "examples" / "data" / "tasks.jsonl").read_text().splitlines()[:40]
    data.write_text("\n".join([*rows, '{"prompt": "no completion"}']) + "\n")
    proc = run_cli("train", TINY, f"data.train_file={data}", "data.strict=true",
                     f"data.cache_dir={tmp_path / 'cache'}", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"error: {data}:41: missing field 'completion'"], proc.stderr
    assert not (tmp_path / "run" / "model").exists()


def test_tiny_chat_with_packing_learns(tmp_path, data_cache):
    out = tmp_path / "chat"
    proc = run_cli("train", str(ROOT / "examples" / "tiny-chat.yaml"), "--output-dir", str(out),
                     "train.max_steps=60", "train.eval_every=0", "train.eval_batches=4",
                     f"data.cache_dir={data_cache}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "packed into" in proc.stderr
    evals = [r for r in _records(out) if r.get("eval")]
    assert evals[-1]["eval_loss"] < 0.6 * evals[0]["eval_loss"]


def test_strategy_and_micro_batch_auto_run_end_to_end(tmp_path):
    """`auto` takes the planner's pick before any process starts; the workers train with it and record it."""
    out = tmp_path / "auto"
    proc = run_cli("train", TINY, "--output-dir", str(out), "parallel.strategy=auto", "train.micro_batch_size=auto",
                     "train.max_steps=3", "train.eval_every=0", "data.eval_fraction=0", "checkpoint.save_final=false",
                     "checkpoint.at_end=false")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "plan: fsdp2 " in proc.stdout and "(parallel.strategy, train.micro_batch_size: auto)" in proc.stdout
    import yaml

    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["parallel"]["strategy"] in ("ddp", "zero2", "zero3")
    assert isinstance(resolved["train"]["micro_batch_size"], int)
    plan = json.loads((out / "plan.json").read_text())["chosen"]
    assert (plan["strategy"], plan["micro_batch_size"]) == (resolved["parallel"]["strategy"],
                                                           resolved["train"]["micro_batch_size"])
    assert [r for r in _records(out) if not r.get("eval")][-1]["step"] == 3
    proc = run_cli("plan", "--check", str(out))
    assert proc.returncode == 0 and "peak allocated GiB" in proc.stdout and "tokens/s per GPU" in proc.stdout
