"""What the planner needs to know about a model, read from its config alone (no weights).

Parameters are counted by role: the repeated decoder block, the input embedding, the LM head, and the
linear layers LoRA would adapt. For the families whose block layout models.facts knows, the count is
arithmetic on the config (no torch import: `plan` answers on a login node in about a second); any other
model is built on the meta device (no memory, about a second even for 70B, plus torch's import) and
counted module by module. tests/unit/test_plan_shape.py holds the two ways equal. The activation
formulas read the block's widths from the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardtune.errors import ShardtuneError

if TYPE_CHECKING:
    from shardtune.models.facts import BlockLayout


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts (elements) and widths of one decoder-only model."""

    model_type: str
    params: int  # every parameter (tied weights once)
    layers: int
    block_params: int  # one decoder block
    embed_params: int  # the input embedding (V x h)
    head_params: int  # an untied LM head (V x h); 0 when tied to the embedding
    hidden: int
    ffn: int  # MLP inner width
    heads: int
    kv_dim: int  # key (= value) width: kv heads x head dim
    vocab: int
    target_params: int  # weights of the linear layers LoRA adapts (all blocks)
    lora_params: int  # LoRA A + B elements at the planned rank (all blocks)
    adapted: tuple[str, ...] = ()  # the block's linear layers LoRA adapts, by name (q_proj, ...), in module order

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder blocks (embedding, LM head, final norm): FSDP2's root unit."""
        return self.params - self.layers * self.block_params

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in matmuls (all but an untied input embedding)."""
        return self.params - (self.embed_params if self.head_params else 0)


def _width(hf_config: Any, *names: str, default: int | None = None) -> int:
    for name in names:
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    if default is not None:
        return default
    raise ShardtuneError(f"model config ({getattr(hf_config, 'model_type', '?')}) has none of {', '.join(names)}; "
                         "the planner needs the model's sizes: give a complete config.json")


def model_shape(hf_config: Any, lora_targets: list[str] | str | None = None, lora_r: int = 16) -> ModelShape:
    """Count a model's parameters by role from its config (no weights read).

    `lora_targets`: module names LoRA adapts (None: the architecture's defaults; "all-linear": every
    linear layer of the blocks)."""
    from shardtune.models.facts import ARCH_FACTS

    facts = ARCH_FACTS.get(hf_config.model_type)
    if lora_targets is None:
        lora_targets = list(facts.lora_targets) if facts else "all-linear"
    if facts is not None and facts.layout is not None:
        return _counted(hf_config, facts.layout, lora_targets, lora_r)
    return _built(hf_config, lora_targets, lora_r)


def _counted(hf_config: Any, layout: BlockLayout, lora_targets: list[str] | str, lora_r: int) -> ModelShape:
    """The count from the layout's rules (see BlockLayout): q/k/v/o attention over (kv) heads x head_dim, a
    gated MLP, `norms` RMSNorms per block, the embedding, a final norm and the LM head unless tied."""
    h, f, layers = hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_hidden_layers
    heads, vocab = hf_config.num_attention_heads, hf_config.vocab_size
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    q, kv = heads * head_dim, kv_heads * head_dim
    # (in, out, bias) of each linear layer of a block
    attn_bias = layout.bias == "config" and bool(getattr(hf_config, "attention_bias", False))
    qkv_bias = attn_bias or layout.bias == "qkv"
    mlp_bias = layout.mlp_bias and bool(getattr(hf_config, "mlp_bias", False))
    linears = {"q_proj": (h, q, qkv_bias), "k_proj": (h, kv, qkv_bias), "v_proj": (h, kv, qkv_bias),
               "o_proj": (q, h, attn_bias), "gate_proj": (h, f, mlp_bias), "up_proj": (h, f, mlp_bias),
               "down_proj": (f, h, mlp_bias)}
    qk_norm = {"head": 2 * head_dim, "full": q + kv}.get(layout.qk_norm, 0)
    block_params = sum(i * o + (o if bias else 0) for i, o, bias in linears.values()) + qk_norm + layout.norms * h
    target_params = lora_params = 0
    adapted = tuple(name for name in linears if lora_targets == "all-linear" or name in lora_targets)
    for name in adapted:
        i, o, _ = linears[name]
        target_params += layers * i * o
        lora_params += layers * lora_r * (i + o)
    embed_params = vocab * h
    head_params = 0 if getattr(hf_config, "tie_word_embeddings", False) else vocab * h
    params = layers * block_params + embed_params + h + head_params
    return ModelShape(model_type=hf_config.model_type, params=params, layers=layers, block_params=block_params,
                      embed_params=embed_params, head_params=head_params, hidden=h, ffn=f, heads=heads,
                      kv_dim=kv, vocab=vocab, target_params=target_params, lora_params=lora_params, adapted=adapted)


def _built(hf_config: Any, lora_targets: list[str] | str, lora_r: int) -> ModelShape:
    """The count of a meta-device build, module by module (any architecture transformers can build)."""
    from torch import nn

    from shardtune.models.build import build_on_meta
    from shardtune.models.facts import decoder_blocks

    model = build_on_meta(hf_config, "eager")  # counts do not depend on it, and every model has eager (gemma2: no sdpa)
    blocks = decoder_blocks(model, hf_config.model_type)
    params = sum(p.numel() for p in model.parameters())
    block_params = sum(p.numel() for p in blocks[0].parameters())
    embed = model.get_input_embeddings()
    embed_params = embed.weight.numel() if embed is not None else 0
    head = model.get_output_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    head_params = 0 if tied or head is None else head.weight.numel()
    target_params = lora_params = 0
    adapted: list[str] = []
    for index, block in enumerate(blocks):
        for name, module in block.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            if lora_targets != "all-linear" and name.rsplit(".", 1)[-1] not in lora_targets:
                continue
            target_params += module.weight.numel()
            lora_params += lora_r * (module.in_features + module.out_features)
            if index == 0:
                adapted.append(name.rsplit(".", 1)[-1])
    hidden = _width(hf_config, "hidden_size", "n_embd", "d_model")
    heads = _width(hf_config, "num_attention_heads", "n_head")
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv_heads = _width(hf_config, "num_key_value_heads", default=heads)
    ffn = _width(hf_config, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
    vocab = _width(hf_config, "vocab_size")
    return ModelShape(model_type=hf_config.model_type, params=params, layers=len(blocks), block_params=block_params,
                      embed_params=embed_params, head_params=head_params, hidden=hidden, ffn=ffn, heads=heads,
                      kv_dim=kv_heads * head_dim, vocab=vocab, target_params=target_params, lora_params=lora_params,
                      adapted=tuple(adapted))
