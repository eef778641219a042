"""What a weight source is asked for when a model loads: the dtype each parameter keeps, down to the preset's random
init (which draws in it on an accelerator: tests/gpu's `test_random_init_on_the_gpu_draws_in_the_parameters_dtype`)."""

from __future__ import annotations

import weakref

import torch

from shardtune.models.build import build_on_meta
from shardtune.models.presets import preset_config
from shardtune.models.weights import RandomInitSource, load_weights
from shardtune.peft.lora import LoraSource


class Asked:
    """A source that records the dtype each tensor was asked in and hands out the preset's init."""

    def __init__(self) -> None:
        self.init = RandomInitSource(0.02, seed=0)
        self.dtypes: dict[str, torch.dtype | None] = {}
        self.last: weakref.ref | None = None  # the rows handed out last
        self.held = 0  # how often the last rows were still alive when the next were asked for

    def rows(self, name: str, shape: torch.Size, start: int, stop: int,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        self.dtypes[name] = dtype
        self.held += self.last is not None and self.last() is not None
        rows = self.init.rows(name, shape, start, stop, dtype)
        self.last = weakref.ref(rows)
        return rows


def test_each_parameter_is_asked_for_in_the_dtype_it_keeps():
    model = build_on_meta(preset_config("tiny-llama"))
    model.model.layers[0].mlp.to(torch.bfloat16)
    source = Asked()
    load_weights(model, source, torch.device("cpu"))
    kept = {name: p.dtype for name, p in model.named_parameters()}
    assert source.dtypes == kept and torch.bfloat16 in kept.values() and torch.float32 in kept.values()


def test_lora_passes_the_dtype_on_to_the_base_and_draws_its_adapters_in_fp32():
    base = Asked()
    weight = "model.layers.0.self_attn.q_proj.weight"
    lora = LoraSource(base, seed=0, shapes={weight: torch.Size([8, 8])})
    lora.rows("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", torch.Size([8, 8]), 0, 8,
              torch.bfloat16)
    adapter = lora.rows("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
                        torch.Size([4, 8]), 0, 4, torch.bfloat16)
    assert base.dtypes == {weight: torch.bfloat16} and adapter.dtype == torch.float32


def test_on_a_cpu_the_init_is_the_fp32_draw_whatever_dtype_is_asked():
    """init-model's files are the fp32 draw cast; a bf16 draw on a CPU gives other values for some shapes."""
    source = RandomInitSource(0.02, seed=1)
    shape = torch.Size([1000, 3])
    plain = source.rows("model.embed_tokens.weight", shape, 0, 1000)
    asked = source.rows("model.embed_tokens.weight", shape, 0, 1000, torch.bfloat16)
    assert asked.dtype == torch.float32 and torch.equal(asked, plain)


def test_one_tensors_rows_are_alive_at_a_time():
    """load_weights lets each tensor's rows go before it asks for the next: holding them while the next are drawn
    made the load's peak the model plus its two largest consecutive tensors (tiny-llama on a GPU, call 127)."""
    source = Asked()
    load_weights(build_on_meta(preset_config("tiny-llama")), source, torch.device("cpu"))
    assert len(source.dtypes) > 10 and source.held == 0
