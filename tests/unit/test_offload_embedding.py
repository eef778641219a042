"""peft.offload_embedding: LoRA / QLoRA's frozen input embedding kept on the host and looked up there, from the
host copy of the batch's token ids. The same training as with the table on the device, the planner's memory and
time for it, and one-line refusals where it cannot run."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT
from safetensors.torch import load_file, save_file

from shardtune.config import load_config
from shardtune.errors import ShardtuneError

TINY = str(ROOT / "examples" / "tiny.yaml")


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """tiny-llama with its own LM head (the presets tie theirs, as Llama-3.2-1B does; 8B and 70B do not)."""
    from conftest import run_cli

    folder = tmp_path_factory.mktemp("untied") / "model"
    assert run_cli("init-model", str(folder), "--preset", "tiny-llama", "--seed", "1").returncode == 0
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].flip(0).clone()  # not the embedding's
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _losses(cli, out, model, *extra: str) -> tuple[list[float], str]:
    proc = cli("train", TINY, f"model.path={model}", "model.preset=null", "train.precision=bf16",
               "parallel.strategy=zero2", "parallel.one_gpu=direct", "train.max_steps=4", "log.every=1",
               "train.lr=0.003", "train.eval_every=2", "train.eval_batches=2", "--nproc", "1", "--output-dir",
               str(out), *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r.get("loss", r.get("eval_loss")) for r in records if "loss" in r or "eval_loss" in r]  # both
    return losses, proc.stdout + proc.stderr


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_the_embedding_and_the_head_on_the_host_train_as_on_the_device(cli, untied, tmp_path, method) -> None:
    """peft.offload_embedding and peft.offload_head together (one run, each also checked alone below and in
    test_a_head_on_the_host_is_lent_to_each_forward): the same losses, evaluation's included."""
    peft = [f"peft.method={method}", "peft.r=4"]
    on_device, said = _losses(cli, tmp_path / "device", untied, *peft)
    on_host, said_host = _losses(cli, tmp_path / "host", untied, *peft, "peft.offload_embedding=true",
                                 "peft.offload_head=true")
    assert "host memory:" not in said  # each set false off a GPU (auto keeps both on a CPU run's device)
    assert "host memory: the input embedding (0.2 MiB) and the LM head (0.2 MiB)" in said_host  # both went
    assert len(on_host) == len(on_device) >= 6  # 4 steps and 2 evaluations
    assert on_host == pytest.approx(on_device, rel=1e-6, abs=1e-7)
    # the adapters it saved are the trained ones, loadable as usual
    adapter = load_file(str(tmp_path / "host" / "adapter" / "adapter_model.safetensors"))
    assert adapter and not any("embed_tokens" in k for k in adapter)


def test_a_lookup_reads_the_hosts_ids_and_lands_on_the_device() -> None:
    from torch import nn

    from shardtune.parallel.host_embedding import HostEmbedding

    table = nn.Embedding(50, 8).requires_grad_(False)
    ids = torch.randint(0, 50, (2, 1500), generator=torch.Generator().manual_seed(0))  # pieces of 2048 and 952 rows
    host = HostEmbedding(table, torch.device("cpu"))
    host.ids = ids
    # handed the host's ids, it does not read the ids it is called with (on a GPU: no copy back, no wait)
    assert torch.equal(host(torch.full_like(ids, 49)), table(ids))
    assert host.ids is None and host.waited == 0
    assert torch.equal(host(ids), table(ids))  # without: the ids it is given


def _refused_in_one_line(asked: str, cases: tuple[tuple[list[str], str], ...]) -> None:
    """`asked` (a host-weight override) beside each case's overrides: check_combination refuses it in one line
    matching the case's text."""
    from shardtune.parallel import check_combination

    for overrides, match in cases:
        cfg = load_config(TINY, ["train.precision=bf16", asked, *overrides])
        with pytest.raises(ShardtuneError, match=match) as err:
            check_combination(cfg)
        assert "\n" not in str(err.value)


def test_refused_in_one_line_where_it_cannot_run(cli, tmp_path) -> None:
    _refused_in_one_line("peft.offload_embedding=true", (
        (["peft.method=none"], "peft.offload_embedding keeps a frozen input embedding"),
        (["peft.method=lora", "parallel.one_gpu=fsdp2"], "peft.offload_embedding keeps a frozen input embedding"),
        (["peft.method=lora", "parallel.strategy=ddp"], "peft.offload_embedding keeps a frozen input embedding"),
        (["peft.method=lora", "parallel.backend=deepspeed"], "peft.offload_embedding is the FSDP2 backend's")))
    # two processes under parallel.strategy: auto: that refusal, not the planner's "nothing fits"
    proc = cli("train", TINY, "peft.method=lora", "train.precision=bf16", "peft.offload_embedding=true",
               "parallel.strategy=auto", "--nproc", "2", "--output-dir", str(tmp_path / "two"))
    assert proc.returncode == 2 and "peft.offload_embedding keeps a frozen input embedding" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    # the tiny preset ties its embedding to the LM head: refused before launch, in one line
    proc = cli("train", TINY, "peft.method=lora", "train.precision=bf16", "peft.offload_embedding=true",
               "parallel.strategy=zero2", "train.max_steps=1", "--nproc", "1", "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "peft.offload_embedding: this model ties its input embedding to the LM head" in proc.stderr


def test_the_planner_moves_the_table_to_the_host_and_prices_the_rows_copied_in() -> None:
    from shardtune.models.presets import preset_config
    from shardtune.plan.hardware import lookup
    from shardtune.plan.memory import gpu_memory
    from shardtune.plan.setting import setting_from_config
    from shardtune.plan.shape import model_shape
    from shardtune.plan.speed import step_time

    h100 = lookup("h100")
    for preset, untied in (("llama-3-8b", True), ("llama-3.2-1b", False)):
        shape = model_shape(preset_config(preset))
        runs = [setting_from_config(load_config(TINY, ["peft.method=lora", "train.precision=bf16",
                                                       "parallel.strategy=zero2", "train.seq_len=2048",
                                                       "train.micro_batch_size=2", *extra]), 1, 1)
                for extra in (["peft.offload_embedding=false"], [])]  # auto (the default) as true here
        device, host = (gpu_memory(shape, s) for s in runs)
        table = shape.embed_params * 2  # bf16
        assert device.allocated - host.allocated == pytest.approx(table if untied else 0.0)
        assert host.host.get("embedding", 0.0) == (table if untied else 0.0)
        slower = step_time(shape, runs[1], h100).seconds - step_time(shape, runs[0], h100).seconds
        assert slower == pytest.approx(4096 * shape.hidden * 2 / h100.h2d_bytes_per_s if untied else 0.0)


def test_auto_takes_the_host_for_peft_on_a_gpu_and_leaves_an_embedding_that_cannot_go() -> None:
    """peft.offload_embedding: auto (the default): LoRA / QLoRA on a GPU only (not full fine-tuning, not a CPU run,
    not set false), and there only an embedding that can go: a tied one stays on the device without a word, where
    true refuses it in one line."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardtune.parallel.fsdp2 import embedding_to_host
    from shardtune.parallel.host_embedding import HostEmbedding, offload_embedding

    lora = load_config(TINY, ["peft.method=lora"])
    assert lora.peft.offload_embedding == "auto"
    assert embedding_to_host(lora, on_gpu=True) == "auto"
    assert embedding_to_host(lora, on_gpu=False) is False
    assert embedding_to_host(load_config(TINY, ["peft.method=none"]), on_gpu=True) is False
    assert embedding_to_host(load_config(TINY, ["peft.method=lora", "peft.offload_embedding=false"])) is False
    assert embedding_to_host(load_config(TINY, ["peft.method=lora", "peft.offload_embedding=true"])) is True
    for tied in (True, False):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, tie_word_embeddings=tied))
        model.requires_grad_(False)
        before = model.get_input_embeddings().weight
        moved = offload_embedding(model, torch.device("cpu"), required=False)
        if tied:
            assert moved is None and model.get_input_embeddings().weight is before
            with pytest.raises(ShardtuneError, match="ties its input embedding to the LM head"):
                offload_embedding(model, torch.device("cpu"), required=True)
        else:
            assert isinstance(moved, HostEmbedding)


def _tiny_causal_lm(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, tie_word_embeddings=tied))
    return model.requires_grad_(False)


@pytest.mark.parametrize("fused", [False, True])
def test_a_head_on_the_host_is_lent_to_each_forward(fused: bool) -> None:
    """peft.offload_head: the head lives on the host; each forward of the model copies it in once (the decoder's
    inner calls do not), computes the same loss and gradients with it, and ends with the host's weight back in
    the module (the GPU copy dropped: what a plain loss saved of it lives until its backward). With the fused
    loss (models/liger.py's contract, in plain torch here) as Liger's path runs it."""
    from shardtune.models.liger import install_fused_loss, reference_fused_loss
    from shardtune.parallel.host_head import HostHead, offload_head

    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    runs = []
    for on_host in (False, True):
        model = _tiny_causal_lm(tied=False)
        model.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)  # a gradient to compare
        if fused:
            install_fused_loss(model, reference_fused_loss)
        host = offload_head(model, torch.device("cpu")) if on_host else None
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        runs.append((out.loss.detach(), model.model.layers[0].self_attn.q_proj.weight.grad))
        if host is not None:
            assert isinstance(host, HostHead) and host.fetches == 1 and host.lent is None
            assert model.lm_head.weight is host.host  # back on the host between forwards
            with torch.no_grad():
                model(input_ids=ids)  # a forward without labels (evaluation, generation) borrows it too
            assert host.fetches == 2 and model.lm_head.weight is host.host
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_a_head_that_cannot_go_is_refused_in_one_line(cli, tmp_path) -> None:
    from shardtune.parallel.host_head import offload_head

    with pytest.raises(ShardtuneError, match="ties its LM head to the input embedding"):
        offload_head(_tiny_causal_lm(tied=True), torch.device("cpu"))
    trains = _tiny_causal_lm(tied=False)
    trains.lm_head.weight.requires_grad_(True)
    with pytest.raises(ShardtuneError, match="the LM head trains here"):
        offload_head(trains, torch.device("cpu"))
    _refused_in_one_line("peft.offload_head=true", (
        (["peft.method=none"], "peft.offload_head keeps a frozen LM head"),
        (["peft.method=lora", "parallel.one_gpu=fsdp2"], "peft.offload_head keeps a frozen LM head"),
        (["peft.method=lora", "parallel.backend=deepspeed"], "peft.offload_head is the FSDP2 backend's")))
    # the tiny preset ties its head to the embedding: refused before launch, in one line, exit 2
    proc = cli("train", TINY, "peft.method=lora", "train.precision=bf16", "peft.offload_head=true",
               "parallel.strategy=zero2", "train.max_steps=1", "--nproc", "1", "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2 and "peft.offload_head: this model ties its LM head" in proc.stderr, proc.stderr


def test_the_planner_takes_the_head_out_of_backward_and_prices_its_copy_in() -> None:
    """peft.offload_head on 8B LoRA (table 2's run: the direct path, compiled blocks, Liger's fused loss): the peak is
    in backward, where the head is
    on the host, so the peak drops by the head's bf16 bytes; the host holds them; each micro-batch's copy in is
    priced mostly exposed (HEAD_EXPOSED of it: measured 2.1% of 8B LoRA's step at micro-batch 4, calls 134-135). A
    tied head (the 1B) changes nothing."""
    from shardtune.models.presets import preset_config
    from shardtune.plan.hardware import lookup
    from shardtune.plan.memory import gpu_memory
    from shardtune.plan.setting import setting_from_config
    from shardtune.plan.shape import model_shape
    from shardtune.plan.speed import HEAD_EXPOSED, step_time

    h100 = lookup("h100")
    for preset, untied in (("llama-3-8b", True), ("llama-3.2-1b", False)):
        shape = model_shape(preset_config(preset))
        table2 = ["peft.method=lora", "train.precision=bf16", "parallel.compile=true", "parallel.strategy=zero2",
                  "train.seq_len=2048", "parallel.activation_checkpointing=full", "train.micro_batch_size=2"]
        runs = [setting_from_config(load_config(TINY, [*table2, *extra]), 1, 1, liger=True)
                for extra in ([], ["peft.offload_head=true"])]
        on_gpu, on_host = (gpu_memory(shape, s) for s in runs)
        head = shape.head_params * 2  # bf16
        assert on_gpu.phase.startswith("backward") and on_host.phase.startswith("backward")
        assert on_gpu.allocated - on_host.allocated == pytest.approx(head if untied else 0.0)
        assert on_host.host.get("head", 0.0) == (head if untied else 0.0)
        slower = step_time(shape, runs[1], h100).seconds - step_time(shape, runs[0], h100).seconds
        assert slower == pytest.approx(HEAD_EXPOSED * head / h100.h2d_bytes_per_s if untied else 0.0)


def test_strategy_auto_takes_the_head_to_the_host_only_where_that_is_what_fits() -> None:
    """peft.offload_head: auto (the default) is off for a run as configured; under parallel.strategy: auto the
    search prices each direct PEFT setting with the head on the host beside it (the table's `+l`) and takes it
    where nothing faster fits without it: 8B LoRA, compiled, on a 20 GiB GPU full checkpointing fits only with the
    head on the host (faster than the activation offload that fits without it), on a 24 GiB one without. The
    workers' overrides carry it; false keeps it off."""
    from dataclasses import replace

    from shardtune.models.presets import preset_config
    from shardtune.plan import auto_overrides, resolve_auto
    from shardtune.plan.hardware import lookup
    from shardtune.plan.memory import GIB
    from shardtune.plan.setting import setting_from_config

    given = ["data.train_file=examples/data/tasks.jsonl", "model.preset=llama-3-8b", "peft.method=lora",
             "parallel.compile=true", "model.liger=loss", "parallel.strategy=auto", "train.micro_batch_size=2"]
    bench = str(ROOT / "bench" / "bench.yaml")
    hf = preset_config("llama-3-8b")
    assert load_config(bench, given).peft.offload_head == "auto"
    assert not setting_from_config(load_config(bench, [*given, "parallel.strategy=zero2"]), 1, 1).offload_head

    def pick(gib: float, *extra: str):
        cfg = load_config(bench, [*given, *extra])
        resolved, plan = resolve_auto(cfg, hf, replace(lookup("h100"), memory_bytes=gib * GIB), world=1, per_node=1)
        return resolved, plan

    resolved, plan = pick(20)
    chosen = plan.chosen().setting
    assert chosen.head_offloaded and chosen.activation_checkpointing == "full" and not chosen.activation_offload
    assert "peft.offload_head=true" in auto_overrides(resolved, plan.auto)
    assert load_config(bench, [*given, *auto_overrides(resolved, plan.auto)]).peft.offload_head is True
    assert not pick(24)[1].chosen().setting.head_offloaded
    kept_off = pick(20, "peft.offload_head=false")[1].chosen().setting
    assert not kept_off.head_offloaded and kept_off.activation_offload  # the next way that fits
