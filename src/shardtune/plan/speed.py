"""Time per optimizer step: FLOPs over the GPU's matmul rate, collective bytes over the bus, and the
host's share under offload. Constants in CAPITALS were fitted to one H200 (bench/RESULTS.md, "planner
accuracy") and are documented there; the hardware's ceilings come from plan/hardware.py (or
`shardtune calibrate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardtune.plan.memory import NF4_BYTES, host_head_bytes, keeps_dequantised, offloaded_activations
from shardtune.plan.setting import Setting
from shardtune.plan.shape import ModelShape

# Share of the calibrated matmul rate a whole training step reaches. It grows with the hidden width h
# (small GEMMs and the non-matmul kernels weigh more in small models) and with the work of one GEMM,
# tokens x h (a micro-batch of few tokens leaves the GPU underfilled):
#     EFF_MAX * h / (h + EFF_H0) * (T h) / (T h + EFF_X0)
# Fitted to the planner-accuracy rows of bench/RESULTS.md (one H200; 1B and 8B shapes, 4k-16k tokens).
# Least-squares fit over 13 rows (log error; grid over EFF_H0 and EFF_X0, EFF_MAX the log-mean): 3.4% rms
# (bench/fit_speed.py; refitted 2026-12-04 when attention got its own rate, ATTN_EFF).
EFF_MAX = 0.730
EFF_H0 = 700.0
EFF_X0 = 3.0e6
# Attention kernels (SDPA's flash and memory-efficient kernels, flex) skip the masked half of causal attention:
# they run half of the 12·L·h·s that MFU counts. Eager attention multiplies the whole score matrix.
CAUSAL_SHARE = 0.5
# Those kernels' rate as a share of the calibrated matmul rate (forward, recompute and backward together). Fitted
# (bench/fit_speed.py) to 8B QLoRA at 131,072 tokens, plain and with activation offload (2026-12-04, calls 35-36:
# attention is 82% of the step there); held out: 262,144 and 327,680 tokens.
ATTN_EFF = 0.55
# torch.compile of each block fuses the elementwise kernels (measured 1.20-1.23x on the 1B shape).
COMPILE_SPEEDUP = 1.2
# Liger-Kernel (model.liger; one H200, 2026-12-02, bench/RESULTS.md), each with its fused loss: 1B full
# fine-tuning with its kernels in eager blocks ran 1.17x plain eager (50,456 tokens/s against 43,204 in another
# call), inside compiled blocks 0.85x compiled (its Triton kernels cut Inductor's fusion), the fused loss alone
# with compiled blocks 0.97x; 8B LoRA with checkpointing 0.96x (6,958 against 7,225 in another call). LoRA / QLoRA
# with compiled blocks and the fused loss alone (model.liger: loss, the fastest PEFT setting) is fitted on its own:
# the 17 rows on record (8B LoRA / QLoRA and 70B QLoRA, calls 26-51) all ran 6-14% faster than priced with 0.96
# (geometric mean 1.11x; bench/RESULTS.md 2026-12-04, eighteenth session).
LIGER_EFF = {"eager": 1.17, "compiled": 0.85, "loss": 0.97, "peft": 0.96, "peft_compiled_loss": 1.07}
# Liger's fused loss adds each chunk's share of the LM head's gradient into its fp32 accumulator (an addmm that
# reads and writes all V x h of it, 1 GB at 1B), and LIGER_EFF was measured with Liger's own chunk (256 tokens at
# 1B, micro-batch 4: 32 a step). model.liger_chunk's larger chunks save that traffic for each chunk fewer, at this
# share of HBM bandwidth: 1B on one H200 (bench/RESULTS.md 2026-12-04, seventeenth session, call 45), 1024-token
# chunks (8 a step) ran 19.6 ms a step faster than 256 (32): 24 x 2.1 GB in 19.6 ms.
FUSED_CHUNK_EFF = 0.6
# The device bandwidth LIGER_EFF and FUSED_CHUNK_EFF were fitted at (the H200's copy rate, hardware.py): the
# accumulator traffic of Liger's own chunks is inside LIGER_EFF there, and takes longer where HBM is slower.
LIGER_FIT_HBM = 4.3e12
# train.float8: the blocks' Linear layers in float8 (torchao), each recipe's speedup on the time of those layers'
# matmuls (forward, recompute, backward; casts included), against bf16 at the same kernel efficiency. Each fitted
# on its own rows (one H200, compiled blocks, Liger's loss, bench/RESULTS.md twenty-first session, calls 64-66):
# full fine-tuning on the 1B shape (tensorwise 1.162 and 1.132 in two calls, geometric mean; rowwise 0.916, its
# per-row casts cost more than the K = 2,048 matmuls save), LoRA on the 8B shape with full checkpointing (the
# frozen base's forward and input-gradient matmuls: tensorwise 1.294 and 1.224; rowwise 1.228). Other shapes are
# extrapolated: larger matmuls gain more. Eager blocks were not measured; with LoRA they also form the frozen
# weights' gradients (2 FLOPs per weight and token) that compile drops (peft.base_dtype: float8 never forms them).
FLOAT8_SPEEDUP = {("tensorwise", "full"): 1.147, ("rowwise", "full"): 0.916,
                  ("tensorwise", "peft"): 1.259, ("rowwise", "peft"): 1.228}
# LoRA's frozen base cast to float8 at every pass (peft.base_dtype: bf16 under train.float8: tensorwise) reads each
# adapted weight and writes its cast in the forward, the recompute and the backward: bytes per weight and pass, at
# HBM speed, fitted on one call (one H100, 8B LoRA, full checkpointing, compiled: the kept casts' step 25.2 ms
# shorter, 350.9 against 325.7 ms; bench/RESULTS.md twenty-fifth session, call 74). FLOAT8_SPEEDUP's LoRA figure
# includes these casts (its rows cast every pass): a kept base saves them.
FLOAT8_CAST_BYTES = 3.6
# LoRA's adapter matmuls are small and memory-bound: bytes moved per adapter element per token, at HBM speed.
LORA_OVERHEAD = 0.1
# The optimizer step streams every trainable parameter's state: fused AdamW reads fp32 p, g, m, v and writes
# p, m, v (28 bytes); torchao's 8-bit AdamW (dequantise, update, requantise in eager blocks) costs as much as
# moving ~125 bytes (measured: 0.93x of AdamW on the 1B shape).
OPTIM_BYTES = {"adamw": 28.0, "adamw8bit": 125.0}


def optimizer_bytes(s: Setting) -> float:
    """HBM bytes per trainable parameter of one update (OPTIM_BYTES). The direct path's compiled update
    (optim.fused: compiled) reads each gradient twice (the norm, the update) as it holds it (Setting.gradient_bytes)
    and writes the compute-dtype copy as it writes the master (so backends.copy_bytes counts no cast back):
    24 bytes of p, m, v read and written, 2 x g, and p. Its other saving, the gradient cast into an fp32 master
    during backward, sits inside the direct path's fitted efficiency (DIRECT_EFF) and is not credited until
    measured."""
    if s.compiled_update_runs:
        return 24.0 + 2 * s.gradient_bytes + (s.compute_bytes if s.peft == "none" else 0)
    return OPTIM_BYTES[s.optim]
# The fused NF4 dequantisation kernel moved 1,722 GB/s on an H200 (bench/nf4_linear.py; 0.35 of its HBM fitted to
# the QLoRA steps, 1.5 TB/s). Priced from the H100's HBM (the same chip with 30% less bandwidth), 8B QLoRA ran
# 10-11% faster than predicted (calls 83-84, bench/RESULTS.md twenty-eighth session): taken as bound by the SMs, so
# its rate follows the compute peak (bytes per peak FLOP), capped by the HBM. On an H100 it moved 1,718 GB/s (call
# 110, bench/RESULTS.md thirty-sixth session): the H200's rate, as this assumes.
DEQUANT_BYTES_PER_FLOP = 0.35 * 4.3e12 / 989e12
# fp32 compute runs on TF32 tensor cores at half the bf16 rate at best.
FP32_RATE = 0.5
# Share of collective time hidden behind compute (FSDP2 prefetches the next all-gather and overlaps the
# reduce-scatter with the previous block's backward).
OVERLAP = 0.8
# parallel.activation_offload's copies run on a side stream beside the compute (parallel/prepare.py
# ActivationOffload): what the compute cannot hide is exposed, and this share of them always. Measured: 8B QLoRA at
# 131,072 tokens as fast with them as without on an H200 (-0.1%, call 123); 8 blocks of the 8B at 16,384 tokens
# within the noise of none (+1.6%, where the blocking copies cost 3.3%; call 124); 8B QLoRA at 32,768 tokens 2.7%
# under call 119's run without them on another H100 (across calls). Not zero, so that the search never takes the
# offload (less GPU memory: its tie-break) over a run that fits without it.
OFFLOAD_EXPOSED = 0.1
# peft.offload_head's copy in, each forward, is exposed far more than the offload's: 8B LoRA at micro-batch 4 with the
# blocks' inputs on the host ran 2.1% slower with the head on the host (11,722 / 11,696 tokens/s in calls 134-135
# against 11,956 / 11,967 in calls 128 and 130, the defaults within 0.3% across those calls): 15 ms of a 1 GB copy
# that takes 19 ms at the H100's rate, where OFFLOAD_EXPOSED priced 2 ms (bench/RESULTS.md forty-fourth session).
HEAD_EXPOSED = 0.75
# Fixed host-side cost per micro-batch (Python, kernel launches, the data batch's copy), seconds.
STEP_OVERHEAD_S = 0.004
# Selective checkpointing's per-op policy runs through torch's checkpoint TorchDispatchMode, Python called for
# every op of a block in forward and again in the recompute: a fixed cost per layer and micro-batch, seconds.
# Every selective row on record ran 5-29% under the prediction without it, by 2.3-5.8 ms per layer and
# micro-batch whatever the model or the tokens (1B at 32,768 tokens, 8B LoRA at 4,096). Least squares (log
# error) over the five selective rows without 8-bit AdamW: 4.1 ms; fitted on the three of calls 20-33 alone it
# is 3.7 ms and predicts the two later rows (8B QLoRA, 1B at seq 16,384) within +4.7% and +3.5%. On this
# project's 2-core CPU a micro block (hidden 64, 16 tokens: all host) costs 1.5 ms more per layer than full
# checkpointing, 3.9 ms with LoRA adapters (the adapters' small ops pass through the policy too). Every selective
# row on record is eager; under compile the policy runs only while Dynamo traces the block (tests/unit/
# test_selective_checkpointing.py: no call after the first step), so compiled selective is not charged it.
SELECTIVE_LAYER_S = 0.0041


@dataclass
class StepTime:
    seconds: float
    tokens_per_sec_per_gpu: float
    mfu: float
    terms: dict[str, float]  # seconds per step: compute, communication (exposed), offload, overhead
    comm_bytes: dict[str, float]  # bytes each GPU sends per step, by collective


def train_flops_per_token(m: ModelShape, s: Setting) -> float:
    """FLOPs the GPU runs per token, recompute included.

    6N + 12·L·h·s (PaLM / torchtitan: 2 FLOPs per weight forward, 4 backward; attention scores and values
    12·L·h·s). Frozen weights (LoRA, QLoRA) cost forward + input gradient: 4 per weight; adapters 6.
    Full checkpointing runs every block's forward again: + 2 per block weight + 4·L·h·s; inside the compiled
    backward (Setting.checkpoint_traced) the recompute leaves out what no gradient reads, the down projection
    (the block's output): - 2·L·h·f; a memory budget's recompute its measured share of that traced one
    (Setting.budget_recompute);
    selective checkpointing only the k, o and up projections: + 2·L·h·(k + h + f); parallel.tiled_mlp each
    tile's forward once more in its backward: + 2·L·3·h·f."""
    n = m.matmul_params
    attn = 12.0 * m.layers * m.hidden * s.seq_len
    flops = (6.0 * n if s.peft == "none" else 4.0 * n + 6.0 * m.lora_params) + attn
    if share := s.recompute_share(m.layers):  # full checkpointing: 1 (N / L of N blocks); a budget: its share
        flops += share * (2.0 * m.layers * m.block_params + 4.0 * m.layers * m.hidden * s.seq_len)
        if s.recompute_compiled:
            flops -= share * 2.0 * m.layers * m.hidden * m.ffn
    elif s.activation_checkpointing == "selective":  # the k, o and up projections run again; attention does not
        flops += 2.0 * m.layers * m.hidden * (m.kv_dim + m.hidden + m.ffn)
    if s.mlp_tiled:
        flops += 2.0 * m.layers * 3 * m.hidden * m.ffn
    return flops


def attention_flops_per_token(m: ModelShape, s: Setting) -> tuple[float, float]:
    """(counted, run): the attention scores and values in train_flops_per_token (12·L·h·s, + 4·L·h·s when full
    checkpointing runs the forward again) and what the kernel runs of them (CAUSAL_SHARE unless eager)."""
    counted = (12.0 + 4.0 * s.recompute_share(m.layers)) * m.layers * m.hidden * s.seq_len
    return counted, counted * (1.0 if s.attn == "eager" else CAUSAL_SHARE)


def forward_share(m: ModelShape, s: Setting) -> float:
    """The forward's share of train_flops_per_token: 2 FLOPs per weight and 4·L·h·s of attention."""
    return (2.0 * m.matmul_params + 4.0 * m.layers * m.hidden * s.seq_len) / train_flops_per_token(m, s)


def model_flops_per_token(m: ModelShape, s: Setting) -> float:
    """FLOPs per token as MFU counts them (no recompute): what metrics/flops.py logs."""
    from shardtune.metrics.flops import flops_per_token

    if s.peft == "none":
        return flops_per_token(m.matmul_params, m.layers, m.hidden, s.seq_len)
    return flops_per_token(m.matmul_params, m.layers, m.hidden, s.seq_len, trainable=m.lora_params)


def kernel_efficiency(m: ModelShape, s: Setting) -> float:
    work = s.tokens * m.hidden
    eff = EFF_MAX * m.hidden / (m.hidden + EFF_H0) * work / (work + EFF_X0)
    if s.compile:
        eff *= COMPILE_SPEEDUP
    eff *= liger_efficiency(s)
    eff *= s.rules.efficiency(s)  # the engine against FSDP2 (plan/backends.py: DeepSpeed, DDP's autocast)
    if s.precision == "fp32":
        eff *= FP32_RATE
    return eff


def liger_efficiency(s: Setting) -> float:
    """Liger's effect on the block and loss kernels (LIGER_EFF); 1 without it."""
    if not (s.liger_kernels or s.fused_loss):
        return 1.0
    if s.peft != "none":
        return LIGER_EFF["peft_compiled_loss" if s.compile and not s.liger_kernels else "peft"]
    if s.liger_kernels:
        return LIGER_EFF["compiled" if s.compile else "eager"]
    return LIGER_EFF["loss"]


def fused_chunk_seconds(m: ModelShape, s: Setting, hw: Any) -> float:
    """Time model.liger_chunk and model.liger_accum save (negative) or cost against Liger's own chunk with an fp32
    accumulator, where LIGER_EFF was measured: the LM head's gradient read and written once per chunk, each chunk
    fewer at FUSED_CHUNK_EFF (fitted on chunk sizes: a chunk's other costs go with it), and the accumulator's
    bytes in the weight's dtype instead of fp32 at the device's rate (one H100, 1B, 8 chunks a step: 2.2 and 2.9
    ms a step faster measured in calls 98 and 100, 2.5 priced). Liger's own chunks' traffic is taken off at the
    bandwidth it was fitted at (LIGER_FIT_HBM), this run's priced at the device's: on an H100 the 1B's 32 fp32
    passes cost 11 ms a step more than on the H200 (its rows had run 5-8% under the price). Nothing when the head
    is frozen (LoRA / QLoRA: no gradient to accumulate) or the loss is plain."""
    if not s.fused_loss or s.peft != "none":
        return 0.0
    from shardtune.models.liger_rules import fused_loss_chunk

    def chunks(rows: int) -> int:
        return -(-s.tokens // fused_loss_chunk(s.tokens, m.vocab, m.hidden, rows)[1])

    liger = chunks(0) * 4 / FUSED_CHUNK_EFF  # fp32 passes of the accumulator with Liger's chunk, as fitted
    # this run's: one per chunk, in the weight's dtype where model.liger_accum says so
    ours = chunks(s.liger_chunk) * (4 / FUSED_CHUNK_EFF + s.head_accum_bytes - 4)
    return (ours / hw.hbm_bytes_per_s - liger / LIGER_FIT_HBM) * 2 * m.vocab * m.hidden * s.grad_accum


def comm_bytes(m: ModelShape, s: Setting) -> dict[str, float]:
    """Bytes each GPU puts on the bus per optimizer step, by collective (ring algorithms: an all-gather or
    reduce-scatter of B bytes over n ranks moves B(n-1)/n per rank, an all-reduce twice that).

    zero3 / hsdp gather the parameters twice per micro-batch (forward and backward) except the last decoder
    block, which parallel/fsdp2_engine.py keeps gathered from forward to backward (communication accounting counts
    exactly this on 2 CPU processes, tests/dist/test_comm.py); zero2 gathers everything once; every
    sharded strategy reduce-scatters fp32 gradients per micro-batch (FSDP2 syncs each one); DDP all-reduces
    once per step. hsdp adds an all-reduce of the sharded gradients across its replica groups. DeepSpeed
    stage 1-2 all-reduce / reduce-scatter the gradients and all-gather the updated parameters once a step.
    LoRA gathers the frozen base and the adapters the same way but reduces only the adapters' gradients; with
    parallel.shard_frozen=false it gathers the adapters (and QLoRA's NF4 weights) only. Counted on 2 CPU processes
    to the byte for full fine-tuning and LoRA (QLoRA's NF4 all-gather moves more than its 0.52 bytes per weight:
    not modelled)."""
    if s.world == 1:
        return {}
    return s.rules.comm_bytes(m, s, *_gathered_bytes(m, s))


def _gathered_bytes(m: ModelShape, s: Setting) -> tuple[float, float]:
    """(what FSDP2 / ZeRO-3 all-gathers once, the last decoder block's share of it) in bytes: every parameter it
    manages, in the compute dtype (NF4 weights as NF4). parallel.shard_frozen=false leaves the compute-dtype frozen
    weights out: the adapters (and NF4 weights) remain, all inside the blocks."""
    p, adapters = s.compute_bytes, (m.lora_params if s.peft != "none" else 0.0) * s.compute_bytes
    nf4 = m.target_params * NF4_BYTES if s.peft == "qlora" else 0.0
    if s.frozen_local:
        return adapters + nf4, (adapters + nf4) / m.layers
    base = m.params * p - (m.target_params * (p - NF4_BYTES) if s.peft == "qlora" else 0.0)
    block = m.block_params * p - (m.target_params / m.layers * (p - NF4_BYTES) if s.peft == "qlora" else 0.0)
    return base + adapters, block + adapters / m.layers


def comm_seconds(m: ModelShape, s: Setting, hw: Any) -> float:
    """Collective time per step: the shard group's traffic goes over NVLink when it fits in one node, else
    over the inter-node network; hsdp's cross-group all-reduce always crosses nodes when nnodes > 1."""
    by_kind = comm_bytes(m, s)
    if not by_kind:
        return 0.0
    intra = s.rules.shard_group(s) <= s.per_node
    seconds = 0.0
    for kind, nbytes in by_kind.items():
        crosses = (not intra) or (kind == "all_reduce" and s.strategy == "hsdp" and s.nnodes > 1)
        bw = hw.inter_node_bus_bytes_per_s if crosses else hw.intra_node_bus_bytes_per_s
        seconds += nbytes / bw
    return seconds


def gather_copy_seconds(m: ModelShape, s: Setting, hw: Any) -> float:
    """The backend's own copies through HBM, not hidden (plan/backends.py copy_bytes: FSDP2's all-gather buffer
    in and out, also on a mesh of one; parallel.one_gpu: direct's casts)."""
    return s.rules.copy_bytes(m, s) / hw.hbm_bytes_per_s


def offload_seconds(m: ModelShape, s: Setting, hw: Any, compute: float) -> float:
    """DeepSpeed ZeRO-Offload: each rank's fp32 gradients go to the host and its updated compute-dtype
    parameters come back over PCIe, and the node's CPU runs AdamW over the node's partitions (ranks on a
    node share its cores); NVMe adds reading and writing the states (not modelled beyond the host rate).
    parallel.activation_offload copies the offloaded activations out in forward and back in backward, once per
    micro-batch, on a side stream: the copies out exposed where they outlast the forward's share of `compute`
    (the step's compute seconds), those back where they outlast the rest, and OFFLOAD_EXPOSED of them always
    (torch's save_on_cpu, which blocks, cost the 8 blocks of the 8B 3.3% at 16,384 tokens where the side stream
    cost nothing measurable)."""
    one_way = offloaded_activations(m, s) * s.grad_accum / hw.h2d_bytes_per_s
    forward = compute * forward_share(m, s)
    activations = (max(one_way - forward, 0.0) + max(one_way - (compute - forward), 0.0)
                   + OFFLOAD_EXPOSED * 2 * one_way)
    if s.embedding_on_host(m):  # peft.offload_embedding: each micro-batch's rows copied in, queued on the stream
        activations += s.tokens * m.hidden * s.frozen_bytes * s.grad_accum / hw.h2d_bytes_per_s
    if s.head_on_host(m):  # peft.offload_head: each forward's copy in on the side stream, as the offload's copies
        head = host_head_bytes(m, s) / hw.h2d_bytes_per_s
        activations += (max(head - forward / s.grad_accum, 0.0) + HEAD_EXPOSED * head) * s.grad_accum
    if s.offload == "none":
        return activations
    trainable = m.params if s.peft == "none" else m.lora_params
    share = trainable / s.world
    pcie = share * (4 + s.compute_bytes) / hw.h2d_bytes_per_s
    if s.offload == "params":
        pcie += 2 * share * s.compute_bytes * s.world / hw.h2d_bytes_per_s * s.grad_accum  # gathers from host
    adam = share * s.per_node / hw.host_adam_params_per_s
    return pcie + adam + activations


def weight_passes(m: ModelShape, s: Setting) -> float:
    """Passes over each frozen weight per micro-batch: forward and backward, and the recompute's forward under
    checkpointing (the checkpointed blocks' share; its share under parallel.activation_memory_budget)."""
    if s.activation_checkpointing == "none":
        return 2.0 + s.budget_recompute
    return 2.0 + s.checkpointed_layers(m.layers) / m.layers


def dequant_passes(m: ModelShape, s: Setting) -> float:
    """Dequantisations of each NF4 weight per micro-batch. Eager (NF4Linear): weight_passes, its backward
    dequantising again. Compiled blocks: one per run of the block's forward graph and none more in backward. Under
    checkpointing inside the compiled block the recompute's dequantisation and backward's are one node
    (AOTAutograd's CSE) in the backward graph; around it, the recompute's forward keeps the weights for backward
    (memory.NF4_COMPILED_COPIES); under a memory budget up to memory.KEPT_DEQUANT_BUDGET backward dequantises
    again. Otherwise the forward keeps every block's dequantised weights for backward (memory.keeps_dequantised):
    one pass. Counted in tiny Llama QLoRA's AOT graphs on CPU (TORCH_LOGS=aot_graphs, inside, around, selective,
    none, budgets 0-0.8; bench/RESULTS.md thirty-seventh session). Priced at three passes, the 26
    compiled 8B / 70B QLoRA rows on record were predicted 4.8% slow on average (mean error 5.6%); at these, 2.8%
    (4.3%), and the H100's inside rows -4.6..-6.2% (were -7.3..-8.9%)."""
    if not s.compile:
        return weight_passes(m, s)
    return 1.0 if keeps_dequantised(s) else 2.0


def float8_saving(m: ModelShape, s: Setting, seconds_per_flop_token: float, hw: Any) -> float:
    """Seconds train.float8 takes off the blocks' linear matmuls (FLOAT8_SPEEDUP), less the frozen weights'
    gradients eager LoRA forms and drops, plus the per-pass casts a kept float8 base does not make;
    `seconds_per_flop_token` = tokens / bf16 rate."""
    frozen = s.peft != "none"
    per_weight = (4.0 if frozen else 6.0) + 2.0 * s.recompute_share(m.layers)
    linear = per_weight * m.layers * m.block_params * seconds_per_flop_token
    saving = linear * (1.0 - 1.0 / FLOAT8_SPEEDUP[(s.float8, "peft" if frozen else "full")])
    if frozen and not s.compile and not s.base_float8:  # its kept casts skip the weights' gradients
        saving -= 2.0 * m.layers * m.block_params * seconds_per_flop_token / FLOAT8_SPEEDUP[(s.float8, "peft")]
    if frozen and s.base_float8:
        passes = weight_passes(m, s)
        saving += passes * s.grad_accum * m.target_params * FLOAT8_CAST_BYTES / hw.hbm_bytes_per_s
    return saving


def step_time(m: ModelShape, s: Setting, hw: Any) -> StepTime:
    tokens = s.tokens * s.grad_accum
    rate = hw.bf16_flops * hw.matmul_efficiency * kernel_efficiency(m, s)
    counted, run = attention_flops_per_token(m, s)
    compute = tokens * (train_flops_per_token(m, s) - counted) / rate
    if s.float8 != "false":
        compute -= float8_saving(m, s, tokens / rate, hw)
    # Eager attention is batched matmuls at the GEMM rate; the fused kernels run at their own.
    compute += tokens * run / (rate if s.attn == "eager" else hw.bf16_flops * hw.matmul_efficiency * ATTN_EFF)
    if s.peft != "none":
        compute += LORA_OVERHEAD * tokens * m.lora_params * 8 / (hw.hbm_bytes_per_s)
    if s.peft == "qlora":
        # Each NF4 weight is dequantised in each pass (dequant_passes) of every micro-batch: reads 4 bits and
        # writes the compute dtype.
        passes = dequant_passes(m, s)
        compute += passes * s.grad_accum * m.target_params * (NF4_BYTES + s.compute_bytes) / min(
            hw.bf16_flops * DEQUANT_BYTES_PER_FLOP, hw.hbm_bytes_per_s)
    trainable = m.params if s.peft == "none" else m.lora_params
    optim = trainable / s.optim_shards() * optimizer_bytes(s) / hw.hbm_bytes_per_s if s.offload == "none" else 0.0
    comm = comm_seconds(m, s, hw)
    copies = gather_copy_seconds(m, s, hw)
    exposed = max(comm - OVERLAP * compute, (1 - OVERLAP) * comm)
    offload = offload_seconds(m, s, hw, compute)
    overhead = STEP_OVERHEAD_S * s.grad_accum
    if s.activation_checkpointing == "selective" and not s.checkpoint_traced:  # compiled: decided while tracing
        overhead += SELECTIVE_LAYER_S * m.layers * s.grad_accum
    chunks = fused_chunk_seconds(m, s, hw)
    seconds = compute + optim + copies + exposed + offload + overhead + chunks
    tps = tokens / seconds
    mfu = tps * model_flops_per_token(m, s) / hw.bf16_flops
    return StepTime(seconds=seconds, tokens_per_sec_per_gpu=tps, mfu=mfu,
                    terms={"compute": compute, "optimizer": optim, "gather_copies": copies, "communication": exposed,
                           "offload": offload, "fused_loss_chunks": chunks,
                           "overhead": overhead},
                    comm_bytes=comm_bytes(m, s))
