"""The backend seam on a real one-process gloo group: the backend computes the loss the loop hands it, builds
its optimizer with the loop's factory, and the loop's schedule drives that optimizer's LR."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardtune.assemble import assemble
from shardtune.config import ModelConfig, OptimConfig, PeftConfig, config_from_dict
from shardtune.data import Batch
from shardtune.dist import init_distributed
from shardtune.models.presets import preset_config
from shardtune.parallel import make_backend
from shardtune.train.loss import token_loss_sum
from shardtune.train.optim import OptimizerFactory, build_scheduler, current_lr, lr_factor


@pytest.fixture()
def ctx():
    ctx = init_distributed()
    yield ctx
    dist.destroy_process_group()


def _batch() -> Batch:
    x = torch.randint(4, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    return Batch(input_ids=x, attention_mask=torch.ones_like(x), labels=x.clone())


@pytest.mark.parametrize("strategy", ["zero3"])
def test_backend_uses_the_loss_and_optimizer_it_is_given(ctx, strategy):
    cfg = config_from_dict({"model": {"preset": "tiny-llama"}, "data": {"train_file": "x"}},
                           [f"parallel.strategy={strategy}", "train.precision=fp32"])
    optim = OptimConfig(warmup_steps=2, weight_decay=0.1)
    hf = preset_config("tiny-llama")
    losses = []
    for scale in (1.0, 3.0):
        built = assemble(ModelConfig(preset="tiny-llama"), PeftConfig(), "fp32", hf, ctx.device, 1)
        backend = make_backend(cfg, ctx, lambda logits, labels, s=scale: s * token_loss_sum(logits, labels))
        backend.setup(built.model, built.blocks, built.source, OptimizerFactory(optim, 1e-3))
        assert isinstance(backend.optimizer, torch.optim.AdamW)
        assert [g["weight_decay"] for g in backend.optimizer.param_groups] == [0.1, 0.0]
        schedule = build_scheduler(backend.optimizer, optim, 10)
        for step in range(3):
            assert current_lr(backend.optimizer) == pytest.approx(1e-3 * lr_factor(step, optim, 10))
            losses.append(float(backend.forward_backward(_batch(), torch.tensor(20.0))))
            backend.step()
            assert backend.step_applied
            schedule.step()
    assert losses[0] * 3 == pytest.approx(losses[3])  # the same weights, the loss it was handed


def test_the_direct_fused_update_leaves_its_skip_flag_for_the_loop_to_read(ctx):
    """parallel.one_gpu: direct with fused AdamW decides a non-finite skip in the kernel and does not read the
    flag itself (a read waits for the GPU to finish the backward): step_skipped stays False, skip_flag says it,
    and a skipped step leaves the weights as they were."""
    cfg = config_from_dict({"model": {"preset": "tiny-llama"}, "data": {"train_file": "x"}},
                           ["parallel.strategy=zero2", "train.precision=bf16", "parallel.one_gpu=direct"])
    hf = preset_config("tiny-llama")
    built = assemble(ModelConfig(preset="tiny-llama"), PeftConfig(), "bf16", hf, ctx.device, 1)
    scale = [1.0]
    backend = make_backend(cfg, ctx, lambda logits, labels: scale[0] * token_loss_sum(logits, labels))
    backend.setup(built.model, built.blocks, built.source, OptimizerFactory(OptimConfig(), 1e-3))
    from shardtune.parallel.direct_engine import DirectBackend

    assert isinstance(backend, DirectBackend) and backend.optimizer.defaults.get("fused")
    flags = []
    for s in (1.0, float("nan")):
        scale[0] = s
        before = {n: p.detach().clone() for n, p in backend.module.named_parameters()}
        backend.forward_backward(_batch(), torch.tensor(20.0))
        backend.step()
        assert backend.step_skipped is False and backend.skip_flag is not None
        flags.append(backend.skip_flag.values()[0])
        changed = any(not torch.equal(p, before[n]) for n, p in backend.module.named_parameters())
        assert changed == (s == 1.0)
    assert flags == [0.0, 1.0]
