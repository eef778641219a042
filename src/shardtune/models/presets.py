"""Built-in model shapes for random-init runs and `shardtune init-model` (no hub needed).

Each preset is a transformers config dict. `micro-llama` and `tiny-llama` use the bundled tokenizer's vocabulary;
the real shapes keep their published vocabulary size.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # ~0.13 M parameters, 2 blocks: the plumbing (sharding, checkpoints, resume, signals, export) in seconds on a CPU;
    # learns little (torchtitan's `debugmodel` plays this part). A launch of 8 steps on 2 CPU processes: ~3 s
    # against ~8.5 s with tiny-llama, whose compute dominates there.
    "micro-llama": dict(model_type="llama", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                        max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True,
                        rms_norm_eps=1e-5, initializer_range=0.02),
    # ~3.4 M parameters: trains on a laptop CPU in a minute.
    "tiny-llama": dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, vocab_size=512,
                       max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True,
                       rms_norm_eps=1e-5, initializer_range=0.02),
    # Llama-3.2-1B shape (1.24 B parameters).
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
                         rms_norm_eps=1e-5, initializer_range=0.02),
    # Llama-3-8B shape (8.03 B parameters).
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
                       rms_norm_eps=1e-5, initializer_range=0.02),
    # Llama-3.1-8B shape: Llama-3-8B's weights shapes with 131,072 positions through Llama 3.1's RoPE scaling
    # (long-context training).
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192),
                         tie_word_embeddings=False, rms_norm_eps=1e-5, initializer_range=0.02),
    # Llama-3-70B shape (70.6 B parameters): QLoRA on one H200, full fine-tuning on 8.
    "llama-3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                        max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
                        rms_norm_eps=1e-5, initializer_range=0.02),
}


def preset_config(name: str) -> Any:
    """A transformers PretrainedConfig for a preset."""
    from transformers import AutoConfig

    spec = dict(PRESETS[name])
    return AutoConfig.for_model(spec.pop("model_type"), **spec)
