"""Per-architecture facts, one table keyed by `config.model_type`.

The parallel code never names a model family; it asks this table which module class is the
repeated decoder block (the unit of sharding and activation checkpointing) and which linear layers
LoRA targets by default. Unknown architectures fall back to discovering the repeated block.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

_ATTN_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ArchFacts:
    block_class: str
    lora_targets: tuple[str, ...] = _ATTN_MLP


ARCH_FACTS: dict[str, ArchFacts] = {
    "llama": ArchFacts("LlamaDecoderLayer"),
    "mistral": ArchFacts("MistralDecoderLayer"),
    "mixtral": ArchFacts("MixtralDecoderLayer", ("q_proj", "k_proj", "v_proj", "o_proj")),
    "qwen2": ArchFacts("Qwen2DecoderLayer"),
    "qwen3": ArchFacts("Qwen3DecoderLayer"),
    "gemma": ArchFacts("GemmaDecoderLayer"),
    "gemma2": ArchFacts("Gemma2DecoderLayer"),
    "phi3": ArchFacts("Phi3DecoderLayer", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    "olmo2": ArchFacts("Olmo2DecoderLayer"),
    "granite": ArchFacts("GraniteDecoderLayer"),
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
