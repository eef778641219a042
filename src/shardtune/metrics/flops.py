"""Model FLOPs per token and MFU.

FLOPs per token = 6·N + 12·L·h·s (torchtitan / PaLM convention): 6 per parameter for forward and
backward matmuls, plus the attention score and value matmuls, which grow with sequence length s.
N counts the parameters that take part in matmuls: the input-embedding lookup is not a matmul,
so an untied input embedding is left out (a tied one is the LM head's weight and stays in).
"""

from __future__ import annotations

from typing import Any

# Dense bf16/fp16 tensor-core peak per device, FLOP/s (vendor datasheets, no sparsity). The planner's
# per-GPU-type table (plan/hardware.py) takes its bf16 peaks from here: one table of peaks.
PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100 PCIE": 756e12,  # H100 PCIe datasheet: 1,513 TFLOP/s bf16 with sparsity, half that dense
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "B100": 1750e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10G": 125e12,
    "A10": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
    "MI300X": 1307e12,
    "MI250X": 383e12,
}


def matmul_params(n_params: int, hf_config: Any) -> int:
    """Parameters that take part in matmuls (all but an untied input embedding)."""
    if getattr(hf_config, "tie_word_embeddings", False):
        return n_params
    return n_params - hf_config.vocab_size * hf_config.hidden_size


def flops_per_token(n_matmul_params: int, num_layers: int, hidden: int, seq_len: int,
                    trainable: int | None = None) -> float:
    """Training FLOPs per token: 6·N + 12·L·h·s.

    With frozen weights (LoRA), `n_matmul_params` are the frozen ones and `trainable` the adapters:
    frozen weights cost forward + input gradient (4 per parameter) but no weight gradient, the
    adapters the full 6."""
    if trainable is None:
        return 6.0 * n_matmul_params + 12.0 * num_layers * hidden * seq_len
    return 4.0 * n_matmul_params + 6.0 * trainable + 12.0 * num_layers * hidden * seq_len


def peak_flops(device_name: str) -> float | None:
    """Peak bf16 FLOP/s for a device name such as 'NVIDIA H200'; None when unknown (e.g. a CPU)."""
    name = device_name.upper()
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # longest first: 'L40S' before 'L40' before 'L4'
        if key in name:
            return PEAK_FLOPS[key]
    return None


def mfu(tokens_per_sec_per_device: float, flops_per_tok: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation, a fraction in [0, 1]; None without a known peak."""
    if not peak:
        return None
    return tokens_per_sec_per_device * flops_per_tok / peak
