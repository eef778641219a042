"""Does overlapping parallel.activation_offload's copies with compute pay? (issue 17's lever: "offload of saved
activations to pinned host memory, overlapped with compute")

Eight blocks of the Llama-3-8B shape (random init, bf16, full checkpointing, SDPA) over one long sequence, forward
and backward of the decoder alone (the LM head left out: it does not offload), three ways: no offload; the block
inputs copied to pinned host memory as torch's save_on_cpu does (the host waits for each copy: what shardtune did
until the twenty-fourth session); and the same copies on a side stream (parallel/prepare.py ActivationOffload, the
default now). Prints per variant the median step time of `--steps` steps with min-max, the peak allocated memory,
and the offloaded runs' loss and input gradients against the plain run's (relative; `none_again`, the plain step
repeated, is the noise floor).

    PYTHONPATH=src python3 bench/probe_offload.py                        (one GPU: ~1 minute estimated; at
                                                                          --tokens 32768 over 190 s on an H100)
    PYTHONPATH=src python3 bench/probe_offload.py --cpu --tiny --steps 2  (the plumbing, on CPU)
"""

from __future__ import annotations

import argparse
import functools
import gc
import json

import torch
from timing import spread, times_ms

from shardtune.config import ParallelConfig
from shardtune.models.build import build_on_meta, restore_buffers
from shardtune.models.presets import preset_config
from shardtune.parallel import prepare

VARIANTS = ("none", "blocking", "overlapped")


def build(preset: str, layers: int, device: torch.device, variant: str,
          min_bytes: int) -> tuple[torch.nn.Module, object]:
    hf_config = preset_config(preset)
    hf_config.num_hidden_layers = layers
    model = build_on_meta(hf_config, "sdpa").to_empty(device=device).to(torch.bfloat16)
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    restore_buffers(model, device)
    model.train()
    blocks = list(model.model.layers)
    hooks = None
    if variant != "none":
        hooks = prepare.offload_activations(model, blocks, device.type, min_bytes,
                                            overlap=variant == "overlapped")
    prepare.checkpoint_and_compile(model, blocks, ParallelConfig(activation_checkpointing="full"), device.type)
    return model, hooks


def step(model: torch.nn.Module, embeds: torch.Tensor) -> tuple[float, torch.Tensor]:
    """One forward and backward of the decoder; the loss and the input's gradient (on the host: kept for the
    comparison, it must not count in the next variant's peak)."""
    x = embeds.detach().requires_grad_()
    hidden = model.model(inputs_embeds=x).last_hidden_state
    loss = hidden.float().square().mean()
    loss.backward()
    return float(loss), x.grad.float().cpu()


def rel_diff(a: tuple[float, torch.Tensor], b: tuple[float, torch.Tensor]) -> dict[str, float]:
    return {"loss": abs(a[0] - b[0]) / abs(b[0]),
            "input_grad": float((a[1] - b[1]).abs().max() / b[1].abs().max())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="the tiny-llama preset, 256 tokens")
    ap.add_argument("--layers", type=int, default=8)  # enough that the host cannot queue all of backward at once
    ap.add_argument("--tokens", type=int, default=16384)  # 32768: ~1.3 s a step on an H100 (attention)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list, in the order run (none first "
                    "for the comparison of losses and gradients)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    cuda = device.type == "cuda"
    preset, tokens = ("tiny-llama", 256) if args.tiny else ("llama-3-8b", args.tokens)
    hidden = preset_config(preset).hidden_size
    embeds = torch.randn(1, tokens, hidden, device=device, dtype=torch.bfloat16,
                         generator=torch.Generator(device).manual_seed(1))
    rows, results = [], {}
    for variant in variants:
        before = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0  # 0 unless an earlier variant's model lives
        model, hooks = build(preset, args.layers, device, variant, 0 if args.tiny else prepare.OFFLOAD_MIN_BYTES)
        results[variant] = step(model, embeds)  # also the warm-up (pinned blocks allocated once)
        if variant == "none":  # the same step again: the run-to-run noise floor of the comparison
            results["none_again"] = step(model, embeds)
        else:
            step(model, embeds)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        ms = times_ms(functools.partial(step, model, embeds), args.steps, cuda)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0
        rows.append({"variant": variant, **spread(ms), "allocated_before_gib": round(before, 3),
                     "peak_gib": round(peak, 3), "reserved_gib": round(reserved, 3),
                     "moved_gib_per_step": round(hooks.moved_bytes / 2**30 / (args.steps + 2), 3) if hooks else 0.0})
        del model, hooks
        torch._dynamo.reset()  # the compiled blocks' caches must not keep the model (and its gradients) alive
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    same = {v: rel_diff(results[v], results["none"]) for v in results if v != "none"} if "none" in results else {}
    for r in rows:
        print(json.dumps(r))
    print(json.dumps({"relative_difference_to_none": same, "device": device.type, "preset": preset,
                      "layers": args.layers, "tokens": tokens}))
    base = next((r["ms_median"] for r in rows if r["variant"] == "none"), rows[0]["ms_median"])
    print("| variant | ms per step (median, min-max) | vs none | allocated before GiB | peak alloc GiB | reserved GiB "
          "| moved GiB per step |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['ms_median']:.1f} ({r['ms_min']:.1f}-{r['ms_max']:.1f}) | "
              f"{base / r['ms_median']:.3f}x | {r['allocated_before_gib']} | {r['peak_gib']} | {r['reserved_gib']} | "
              f"{r['moved_gib_per_step']} |")


if __name__ == "__main__":
    main()
