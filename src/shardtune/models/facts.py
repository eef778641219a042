"""Per-architecture facts, one table keyed by `config.model_type`.

The parallel code never names a model family; it asks this table which module class is the
repeated decoder block (the unit of sharding and activation checkpointing), which linear layers
LoRA targets by default and, for the common families, how the block is laid out, so the planner can
count parameters from config.json without building the model (or importing torch). Unknown
architectures fall back to discovering the repeated block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

# A Llama-style block's linear layers, in the order its forward calls them.
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# config.json keys a parameter count needs stated (their class defaults vary by family and by release).
SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class BlockLayout:
    """How a Llama-like block (q/k/v/o attention, gated MLP, RMSNorms) is made, read from transformers' modeling
    code; tests/unit/test_plan_shape.py counts each family both ways (this and a meta-device build).

    bias:     "config": q, k, v and o take config.attention_bias; "qkv": q, k and v always have one, o never;
              "none": no attention bias.
    mlp_bias: whether config.mlp_bias gives gate/up/down a bias.
    qk_norm:  "head": an RMSNorm over head_dim on queries and keys (Qwen3); "full": over the whole q and k
              projections (OLMo-2); "": none.
    norms:    hidden-wide RMSNorms per block.
    defaults: transformers' class defaults of the keys not in SIZE_KEYS (None: derived, as the class does:
              num_key_value_heads = num_attention_heads, head_dim = hidden_size // num_attention_heads)."""

    bias: str = "config"
    mlp_bias: bool = False
    qk_norm: str = ""
    norms: int = 2
    defaults: dict[str, Any] = field(default_factory=dict)


def _defaults(tie: bool = False, kv_heads: int | None = None, head_dim: int | None = None) -> dict[str, Any]:
    return {"tie_word_embeddings": tie, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "attention_bias": False, "mlp_bias": False}


@dataclass(frozen=True)
class ArchFacts:
    block_class: str
    lora_targets: tuple[str, ...] = LLAMA_LINEARS
    layout: BlockLayout | None = None  # None: the planner builds the model on the meta device to count it


ARCH_FACTS: dict[str, ArchFacts] = {
    "llama": ArchFacts("LlamaDecoderLayer", layout=BlockLayout(mlp_bias=True, defaults=_defaults())),
    "mistral": ArchFacts("MistralDecoderLayer", layout=BlockLayout(bias="none", defaults=_defaults(kv_heads=8))),
    "mixtral": ArchFacts("MixtralDecoderLayer", ("q_proj", "k_proj", "v_proj", "o_proj")),
    "qwen2": ArchFacts("Qwen2DecoderLayer", layout=BlockLayout(bias="qkv", defaults=_defaults(kv_heads=32))),
    "qwen3": ArchFacts("Qwen3DecoderLayer", layout=BlockLayout(qk_norm="head",
                                                                defaults=_defaults(kv_heads=32, head_dim=128))),
    "gemma": ArchFacts("GemmaDecoderLayer", layout=BlockLayout(defaults=_defaults(True, kv_heads=16, head_dim=256))),
    "gemma2": ArchFacts("Gemma2DecoderLayer", layout=BlockLayout(norms=4, defaults=_defaults(True, kv_heads=4,
                                                                                             head_dim=256))),
    "phi3": ArchFacts("Phi3DecoderLayer", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    "olmo2": ArchFacts("Olmo2DecoderLayer", layout=BlockLayout(qk_norm="full", defaults=_defaults())),
    "granite": ArchFacts("GraniteDecoderLayer", layout=BlockLayout(mlp_bias=True, defaults=_defaults())),
    "gpt2": ArchFacts("GPT2Block", ("c_attn", "c_proj", "c_fc")),
}


def decoder_blocks(model: nn.Module, model_type: str) -> list[nn.Module]:
    """The repeated decoder blocks, in order. Raises if none are found."""
    facts = ARCH_FACTS.get(model_type)
    if facts is not None:
        blocks = [m for m in model.modules() if type(m).__name__ == facts.block_class]
        if blocks:
            return blocks
    return _discover_blocks(model)


def _discover_blocks(model: nn.Module) -> list[nn.Module]:
    from torch import nn

    # The largest ModuleList whose children all share one class is the stack of decoder blocks.
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            kinds = {type(child) for child in module}
            if len(kinds) == 1 and len(module) > len(best):
                best = list(module)
    if not best:
        raise RuntimeError(f"no repeated decoder block found in {type(model).__name__}; "
                           "add the architecture to shardtune.models.facts.ARCH_FACTS")
    return best
