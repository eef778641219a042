"""Memory per GPU and per node, term by term (bytes).

The peak of a training step comes in one of four phases, and each term is counted in the phases
where it is alive:

  forward end     model states + gathered parameters + every saved activation + the loss's logits
                  (the usual peak: activations are largest just before backward starts)
  backward start  the same without the logits, with the first gradients (LM head, last block) and the
                  recomputed block (checkpointing): the peak when a fused loss never makes the logits
  backward end    model states + gathered parameters + every gradient + the recomputed block
  optimizer       parameters + gradients + optimizer states

Sources and derivations are in each function's docstring. Constants named in CAPITALS were fitted
to measurements on one H200 (bench/RESULTS.md, "planner accuracy"); never to a single answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardtune.models.facts import LLAMA_LINEARS
from shardtune.plan.setting import Setting, piecewise
from shardtune.plan.shape import ModelShape

GIB = 2**30
# NF4 (torchao, QLoRA): 4 bits per weight plus one fp8 scaler per 64-element block and one fp32
# second-level scaler per 256 blocks: 0.5 + 1/64 + 4/(64*256) ≈ 0.516 bytes per parameter.
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
# torchao's 8-bit AdamW: two uint8 moments per parameter plus one fp32 scale per 256-element block each.
ADAMW8BIT_BYTES = 2 + 2 * 4 / 256
# The logits and loss (train/loss.py): the LM head's output in the compute dtype, its shifted copy, the
# fp32 upcast and log-softmax's fp32 output are alive together at the end of forward: 2p + 8 bytes per
# vocabulary entry per token (p = compute bytes). Fitted: the measured share of that transient.
LOGITS_FACTOR = 1.0
# Reserved / allocated in PyTorch's caching allocator (fragmentation, cached blocks). Fitted (median of the
# planner-accuracy rows: 1.18-1.21).
FRAGMENTATION = 0.18
# Checkpointing's recompute allocates and frees a block's activations in backward: more cached blocks
# (measured reserved / allocated 1.27-1.32 on the 1B shape against 1.18-1.20 without).
RECOMPUTE_FRAGMENTATION = 0.08
# LoRA / QLoRA runs allocate little per step besides activations: 1.05-1.18 measured (8B, 70B).
PEFT_FRAGMENTATION = 0.10
# parallel.one_gpu: direct (no FSDP2 gather and reduce-scatter buffers coming and going): 1.006-1.027 measured
# (1B full fine-tuning, 7 rows of calls 42-46).
DIRECT_FRAGMENTATION = 0.03
# Long sequences: the allocator keeps the blocks its largest transients were cut from (a recomputed block's f-wide
# MLP tensors, 9 GiB each at 327,680 tokens of the 8B shape), and reserved exceeds allocated by about 3.7 x p x f
# per token: 12.9-32.0 GiB measured on 8B QLoRA at 131,072-327,680 tokens (calls 35-36, bench/RESULTS.md), where
# the shares above would say 4-9 GiB. Whichever is larger is counted.
CACHED_TRANSIENTS = 3.7
# Under parallel.tiled_mlp the MLP's tensors are a tile's, and the widest transients the hidden-wide ones over the
# whole micro-batch (TILED_HIDDEN_TRANSIENT): reserved exceeded allocated by 7.1 x ph per token eager (327,680 tokens,
# call 147: 69.0 against 51.2 GiB) and 13.8 compiled with the checkpoint around (131,072 tokens, call 145: 34.0
# against 20.2), where the eager share above said 0.4 x ph. One row each (8B QLoRA with the activation offload and
# 8,192-token tiles on one H100); not checked on another.
TILED_CACHED = 7.1
TILED_CACHED_COMPILED = 13.8
# train.float8 in compiled blocks: the partitioner keeps float8 copies where bf16 tensors were saved for backward
# (matmul inputs cast once, reused by the gradient matmuls). Share of a block's saved bytes left, fitted on the 1B
# without checkpointing (one H200, calls 64 and 66: 3.00 GiB less peak of the 9.27 GiB predicted for activations,
# both recipes); it predicts 8B LoRA's recomputed block 0.17 GiB smaller, measured 0.18 (tensorwise; rowwise 0.00).
# Eager float8 saves its bf16 inputs: no change.
FLOAT8_ACTIVATIONS = 0.676
# ... but not with LoRA's frozen float8 base in blocks that keep their activations (no checkpointing, or a
# memory budget's share): the adapters read each projection's bf16 input in backward, so no float8 copy replaces
# it. 8B LoRA float8 at micro-batch 2 without checkpointing (one H100, call 91) peaked 28.21 GiB: 19.0 GiB of
# saved activations, 1.116 x the compiled bf16 count (FLOAT8_ACTIVATIONS said 11.5). Fitted on that one row.
PEFT_FLOAT8_SAVED = 1.116
# parallel.activation_memory_budget: the share of the way from full checkpointing's saved bytes (0) to none's (1)
# compile's partitioner keeps at each budget, read between these points. 8B LoRA float8 at micro-batch 2 on one
# H100 (calls 89 and 91: 11.25 GiB at 0, 14.39 at 0.1, 17.52 at 0.3, 20.04 at 0.5, 28.21 without a budget) kept
# 0.185 / 0.37 / 0.52. Checked off those rows: 8B LoRA bf16 (call 94: 17.96 GiB full, 22.53 at 0.3, 33.16 none)
# kept 0.30 at 0.3 (priced 3.4% high: left so, the side where a plan errs toward not fitting), the 1B full
# fine-tune at 0.5 (call 93) 22.55 GiB (priced 22.59).
# A CPU probe without adapters kept 0.30 / 0.49 / 0.67 at 0.3 / 0.5 / 0.7 (tests/unit/test_checkpoint_in_compile.py).
BUDGET_KEPT = ((0.0, 0.0), (0.1, 0.185), (0.3, 0.37), (0.5, 0.52), (1.0, 1.0))
# A compiled block's backward (one Inductor graph) holds more than the eager count above, by about 3.6 x p x f per
# token. Fitted under checkpointing: 8B LoRA at 4,096 tokens 0.39 GiB over (3.56, calls 38-66, seven rows), 8B QLoRA
# at 131,072 tokens with activation offload 12.95 GiB over (3.70, an H100, call 76, bench/RESULTS.md twenty-sixth
# session); 8B QLoRA at 4,096 tokens is 0.3 GiB more again (its NF4 weights' bf16 copies, not counted). It holds it
# without a recompute too (forty-sixth session): the blocks parallel.checkpoint_blocks leaves out peaked at backward's
# start 0.3-0.5 GiB over the eager count (8B LoRA, calls 134-142: up to 3.1% low, 0.05-0.41% with it; call 142's probe
# found the forward's end within 0.11 GiB), and compiled blocks without checkpointing (8B LoRA and QLoRA, 1B full
# fine-tuning) within 1.3% with it (-1.0% to +0.3% without). What the graph keeps is not known: a memory snapshot
# cannot record these runs (pytorch/pytorch#179536). Counted under selective checkpointing too (not measured there:
# the larger guess, so a plan errs toward not fitting).
COMPILED_BACKWARD = 3.6
# With the checkpoint inside the compiled blocks (Setting.checkpoint_traced) the backward holds about 3.5 x p x f
# per token more again. 8B QLoRA on one H100 (calls 109 and 113, bench/RESULTS.md thirty-sixth session), inside less
# around at the same length: 3.13 / 6.25 GiB at 32,768 / 65,536 tokens, 12.50 GiB at 131,072 with activation offload
# (3.58 / 3.57 / 3.57 x pf per token): the twenty-seventh session's 2pf + 0.15 GiB, fitted on 4,096 and 8,192 tokens,
# priced the long rows 3-8% low. At 4,096 tokens 3.5pf is 0.38 GiB: bf16 LoRA and QLoRA measured 0.39 (calls 82-84),
# 8B LoRA float8 0.36 (calls 79-80; 0.57 at 8,192, priced 0.77: the side where a plan errs toward not fitting).
# Counted for selective under compile too (traced there; not measured: the larger guess).
INSIDE_RECOMPUTE = 3.5
# parallel.tiled_mlp: what one tile's backward holds, x p x f per token of the tile: its recomputed gate, up, SiLU
# and product (4pf, eager) and their gradients' 2pf (backward_transient's untiled count, measured on the GPU). Tiny
# Llama blocks on CPU (bench/probe_inside_memory.py, forty-seventh session) held 3.7pf per tile token more as the
# tile grew from 1,024 to 2,048 tokens: the larger count, so a plan errs toward not fitting. Not measured on a GPU
# (at the lengths measured there, the hidden-wide gradients below set the peak).
TILE_TRANSIENT = 6.0
# ... and, once the MLP's tiles are done, the rest of the recomputed block's backward holds hidden-wide tensors over
# the whole micro-batch: the block's output gradient, the MLP input's (the tiles' gradients joined), the norm's
# gradients (in fp32 where eager). Untiled, the MLP's 2pf (7 x ph on the Llama shapes) hid them. 8B QLoRA with the
# activation offload and 8,192-token tiles on one H100 (calls 145 and 147, bench/RESULTS.md forty-eighth session)
# peaked 8.37 x ph per token over the recomputed block's saved activations compiled (the checkpoint around, 131,072
# tokens: 20.18 GiB) and 7.98 eager (327,680 tokens: 51.20 GiB), where one tile's TILE_TRANSIENT alone priced them
# 13.11 and 32.56. The larger, so a plan errs toward not fitting (eager +1.0 GiB). Fitted on these two rows only.
TILED_HIDDEN_TRANSIENT = 8.4
# Bytes of parallel.activation_offload's copies back the host may queue ahead of the GPU in backward
# (parallel/prepare.py BACK_BYTES): without checkpointing they are each block's activations, on the GPU again
# beside the block whose backward runs.
OFFLOAD_BACK_BYTES = float(1 << 30)
# A compiled QLoRA block's backward holds compute-dtype copies of its NF4 weights, about the MLP's three (h x f
# each): 8B QLoRA with compiled blocks peaked 0.29-0.35 GiB above the count without them in every row on record
# (calls 26-104, H200 and H100, around and inside, the table on the GPU or the host, 4,096 and 131,072 tokens),
# 3 x h x f x 2 bytes = 0.33 GiB; the 70B shape 1.10 GiB above (calls 40 and 80) against 1.31 (the side where a
# plan errs toward not fitting). Eager QLoRA dequantises one layer at a time (0.06-0.13 GiB under: not counted).
NF4_COMPILED_COPIES = 3
# Compiled QLoRA blocks without checkpointing under parallel.activation_memory_budget: backward dequantised the
# weights again at budgets 0, 0.3, 0.5, 0.6 and 0.7, and at 0.8 the forward kept them all (tiny Llama on CPU).
KEPT_DEQUANT_BUDGET = 0.7
# peft.base_dtype: float8: each adapted weight as its tensorwise float8 cast (1 byte; one fp32 scale per layer),
# loaded one layer at a time (assemble.load_kept), so the bf16 base is never whole on the GPU.
FLOAT8_BYTES = 1.0
# CUDA context, cuBLAS / cuDNN handles and kernels loaded outside the caching allocator; NCCL's own
# buffers when there is more than one process (NCCL_BUFFSIZE 4 MiB x channels x peers, ~0.5 GiB).
CUDA_CONTEXT = 0.75 * GIB
NCCL_BUFFERS = 0.5 * GIB
# Compiled blocks keep Inductor's workspaces and generated kernels (~0.3 GiB measured on an H200).
COMPILE_WORKSPACE = 0.3 * GIB
# FSDP2 gathers the next block while the current one computes (prefetch depth 1): two blocks unsharded.
FSDP2_LIVE_BLOCKS = 2
# Host memory of each training process besides its tensors (torch, CUDA libraries, the data).
PROCESS_HOST = 3.0 * GIB


@dataclass
class Memory:
    """Predicted peak per GPU: `terms` (bytes, the peak phase's composition) add up to `allocated`;
    `total` adds the allocator's reserve and the CUDA context: what must fit on the device."""

    terms: dict[str, float]
    phase: str
    allocated: float
    reserved: float
    total: float
    host: dict[str, float] = field(default_factory=dict)  # per node, bytes

    @property
    def host_total(self) -> float:
        return sum(self.host.values())


def activation_bytes_per_token_layer(m: ModelShape, s: Setting, *, kept: bool = False) -> float:
    """Bytes autograd saves per token in one decoder block without checkpointing (Llama-style block:
    RMSNorm, attention with rotary embeddings and grouped KV heads, SwiGLU MLP).

    Re-derived from Korthikanti et al. 2022 ("Reducing Activation Recomputation", eq. 2) for the kernels
    transformers runs, with p = bytes of the compute dtype, h hidden, k the key/value width, f the MLP width,
    a the attention heads:
      2 RMSNorms   each saves its fp32 upcast (4h, for the variance) and the normalised input of the
                   weight multiply (ph)                                                  -> 8h + 2ph
      attention    the q/k/v projections' shared input (ph); RoPE multiplies by cos/sin, which need no
                   gradient, so it saves nothing; the kernel saves rotated q (ph), rotated k and v (2pk),
                   its output (ph, also o_proj's input: the kernel writes it in (b, s, a, d) order, so the
                   transpose back is free) and the log-sum-exp (4a)                      -> 3ph + 2pk + 4a
      SwiGLU       gate/up input (ph), gate output, SiLU output, up output, product (4pf)  -> ph + 4pf
    Eager attention also keeps the fp32 softmax and its compute-dtype copy: (4 + p) x a x s.
    Compiled blocks fuse each norm (it saves its input, ph, instead of the fp32 copy: -8h) and SiLU * up
    (the SiLU output is recomputed: -pf); Liger's RMSNorm and SwiGLU kernels save the same. Under
    parallel.tiled_mlp (more tokens than a tile) the MLP keeps its input only (its tiles' checkpoints): -4pf.
    Checked against autograd's saved tensors of a real block on CPU (tests/unit/test_plan.py). `kept`: a block
    that keeps them through the forward (no checkpointing), not the one a backward recomputes: compiled LoRA
    blocks in float8 save more there (PEFT_FLOAT8_SAVED)."""
    p, h, k, f, a = s.compute_bytes, m.hidden, m.kv_dim, m.ffn, m.heads
    mlp = 0 if s.mlp_tiled else 4 * p * f - (p * f if s.compile or s.liger_kernels else 0)
    total = 8 * h + 6 * p * h + 2 * p * k + mlp + 4 * a
    if s.attn == "eager":
        total += (4 + p) * a * s.seq_len
    if s.compile or s.liger_kernels:
        total -= 8 * h
    total += s.rules.residual_bytes(m, s)  # DDP's autocast: an fp32 residual stream
    if s.float8 != "false" and s.compile:
        total *= PEFT_FLOAT8_SAVED if kept and s.peft != "none" else FLOAT8_ACTIVATIONS
    return float(total)


def budget_kept_share(budget: float) -> float:
    """BUDGET_KEPT read at `budget` (piecewise linear)."""
    return piecewise(BUDGET_KEPT, budget)


def activations(m: ModelShape, s: Setting) -> tuple[float, float]:
    """(saved through the whole forward, extra while one block is recomputed in backward), bytes.

    Without checkpointing every block keeps its activations. With full checkpointing each block keeps
    only its input (p*h per token) and backward recomputes one block at a time (parallel.checkpoint_blocks: the
    first N blocks; the others keep everything, as without checkpointing); selective checkpointing keeps
    the outputs of the attention kernel and of every other matmul (selective_bytes_per_token_layer) and
    recomputes the rest of one block at a time."""
    block_input = float(s.compute_bytes * m.hidden * s.tokens)
    whole = activation_bytes_per_token_layer(m, s, kept=True) * s.tokens
    if s.activation_checkpointing != "none":
        recomputed = activation_bytes_per_token_layer(m, s) * s.tokens
        if s.activation_checkpointing == "full":
            taken = s.checkpointed_layers(m.layers)
            left = m.layers - taken  # kept whole, compiled QLoRA's with their dequantised weights
            unchecked = left * whole + dequantised_kept(m, s.replace(activation_checkpointing="none")) * left / m.layers
            return taken * block_input + unchecked, recomputed if taken else 0.0
        kept = selective_bytes_per_token_layer(m, s) * s.tokens
        return m.layers * kept, max(0.0, recomputed - kept)
    if s.budget_applies:  # parallel.activation_memory_budget: between full checkpointing's and none's
        kept = block_input + budget_kept_share(s.memory_budget) * max(0.0, whole - block_input)
        return m.layers * kept + dequantised_kept(m, s), whole - kept
    return m.layers * whole + dequantised_kept(m, s), 0.0


def keeps_dequantised(s: Setting) -> bool:
    """Whether compiled QLoRA blocks keep their dequantised NF4 weights from forward to backward: without
    checkpointing the partitioner saves each block's compute-dtype weights rather than dequantise again, unless a
    memory budget of at most KEPT_DEQUANT_BUDGET has it recompute them. Read off tiny Llama QLoRA's AOT graphs on
    CPU (bench/RESULTS.md thirty-seventh session); with checkpointing the recompute dequantises
    (NF4_COMPILED_COPIES)."""
    if s.peft != "qlora" or not s.compile or s.activation_checkpointing != "none":
        return False
    return not s.budget_applies or s.memory_budget > KEPT_DEQUANT_BUDGET


def dequantised_kept(m: ModelShape, s: Setting) -> float:
    """Bytes of what keeps_dequantised keeps: every block's weights, 13 GiB on the Llama-3-8B shape (the first
    block's q / k / v too: prepare.one_graph_for_every_block has that block's input need a gradient). Counted with
    autograd's saved tensors of compiled tiny Llama QLoRA on CPU (tests/unit/test_plan.py)."""
    return float(m.target_params * s.compute_bytes) if keeps_dequantised(s) else 0.0


def backward_transient(m: ModelShape, s: Setting) -> float:
    """Gradients a block's backward holds besides its saved activations (bytes): the MLP's is the largest.
    down_proj's backward makes the gradient of its input (pf per token) and frees that input; SiLU(gate) * up's
    backward then makes the gradients of both factors (2pf) before the product's gradient is freed: the saved
    activations less pf plus 3pf, so 2pf per token over the saved ones. Measured (bench/RESULTS.md 2026-12-04):
    8B QLoRA at 327,680 tokens with full checkpointing peaked 17.5 GiB above the recomputed block's saved
    activations; 2pf x 327,680 tokens is 17.5 GiB. A compiled block's backward holds COMPILED_BACKWARD x pf per
    token more (with a recompute or without), INSIDE_RECOMPUTE x pf more with the checkpoint inside it, and a
    compiled QLoRA block NF4_COMPILED_COPIES dequantised weights. Under parallel.tiled_mlp the MLP's backward runs
    one tile at a time, eagerly: the tile's recomputed 4pf and its backward's 2pf per token of the tile
    (TILE_TRANSIENT; tiny Llama blocks on CPU, bench/probe_inside_memory.py: the peak no longer grows with f, and
    below it with the tile's size), or the rest of the block's hidden-wide gradients over every token
    (TILED_HIDDEN_TRANSIENT), whichever is larger: the second at the lengths tiles are for (on a GPU)."""
    fixed = 0.0  # a compiled QLoRA block's dequantised weights in backward, unless the forward kept them all
    if s.compile and s.peft == "qlora" and not keeps_dequantised(s):
        fixed = NF4_COMPILED_COPIES * m.hidden * m.ffn * s.compute_bytes
    if s.mlp_tiled:
        tile = TILE_TRANSIENT * m.ffn * s.tiled_mlp
        return max(tile, TILED_HIDDEN_TRANSIENT * m.hidden * s.tokens) * s.compute_bytes + fixed
    extra = COMPILED_BACKWARD if s.compile else 0.0
    if s.checkpoint_traced:
        extra += INSIDE_RECOMPUTE
    elif s.budget_recompute:  # a recompute inside the compiled backward too: its share of full's
        extra = s.budget_recompute * (COMPILED_BACKWARD + INSIDE_RECOMPUTE)
    return (2.0 + extra) * s.compute_bytes * m.ffn * s.tokens + fixed


def offloaded_activations(m: ModelShape, s: Setting) -> float:
    """Bytes parallel.activation_offload keeps on the host instead of the GPU, per micro-batch
    (parallel/prepare.py): the blocks' inputs under full or selective checkpointing (non-reentrant checkpointing
    saves them through autograd, where the offload hooks see them; selective's saved outputs stay in its own
    cache on the GPU); without checkpointing everything the blocks save. Under parallel.checkpoint_blocks the
    hooks go off at the first block left out: the N checkpointed blocks' inputs only."""
    if not s.activation_offload:
        return 0.0
    if s.activation_checkpointing == "none":
        return activations(m, s)[0]
    return float(s.checkpointed_layers(m.layers) * s.compute_bytes * m.hidden * s.tokens)


def norm_offloaded(m: ModelShape, s: Setting) -> bool:
    """Whether parallel.activation_offload moves the final norm's saved tensors too: its hooks are on to the
    decoder's end, unless parallel.checkpoint_blocks leaves blocks out (the hooks go off at the first of them)."""
    return s.activation_offload and not s.blocks_left_out(m.layers)


def offload_returned(m: ModelShape, s: Setting) -> float:
    """Bytes of offloaded activations back on the GPU in backward without checkpointing: the block's whose
    backward runs and the next block's, copied back while it runs. The host waits for the GPU only once more than
    OFFLOAD_BACK_BYTES of copies back are queued, and then for an unpack queued after the running block's backward:
    so up to the next block's whole set, or the bound plus its last tensor (the MLP's tokens x f, the largest).
    8B QLoRA at 32,768 tokens, budget 0.3 and the offload measured 18.03 GiB (call 138): priced 16.59 with the
    running block and the bound alone, 17.32 so; 8B LoRA at 2,048 tokens 16.17 (calls 127-128): 16.77, 15.99. (Under
    checkpointing what comes back is one block input at a time, inside what the rows the checkpoint's terms were
    fitted on measured.)"""
    if not s.activation_offload or s.activation_checkpointing != "none":
        return 0.0
    moved = offloaded_activations(m, s)
    block = moved / m.layers
    ahead = min(block, OFFLOAD_BACK_BYTES + s.tokens * m.ffn * s.compute_bytes)
    return min(moved, block + ahead)


def final_norm_bytes(m: ModelShape, s: Setting) -> float:
    """What the decoder's final RMSNorm saves: its fp32 upcast and normalised input, (4 + p)h per token. It runs
    inside the decoder's forward, so parallel.activation_offload moves it to the host too, where the pinned
    blocks stay cached for the next step. On the GPU it is alive at forward's end and freed before backward's peaks (its
    backward runs first): counted at forward's end, it brings the 215 rows on record from -0.19% to -0.06% on average
    (the 1B's 22 forward-end rows -0.7% to -0.4%; forty-fourth session).
    Measured host memory in use with offload on 8B QLoRA (`free`, less the idle machine's; bench/RESULTS.md
    2026-12-04): 89.6 / 72.3 / 37.7 GiB at 327,680 / 262,144 / 131,072 tokens; the block inputs and the process
    alone (3 GiB) say 83 / 67 / 35, these add 7.5 / 6 / 3."""
    return float((4 + s.compute_bytes) * m.hidden * s.tokens)


def selective_bytes_per_token_layer(m: ModelShape, s: Setting) -> float:
    """Selective checkpointing (parallel/prepare.py) keeps, per token and block: the block's input (ph), the
    attention kernel's output (ph) and log-sum-exp (4 bytes per head), and the output of every other matmul in
    the order the forward runs them. Without adapters that is q, v, gate and down (p(h + k + f + h)), so
    p(4h + k + f) + 4a. With LoRA each adapted layer runs three matmuls (the base, A, B), which shifts the
    count: on all seven projections the saved ones are q, q's B, v, v's B, gate, gate's B, down, down's B and
    three r-wide A outputs (left out: r << h), p(6h + 2k + 2f) + 4a. The 8B LoRA + selective row on record
    (bench/RESULTS.md 2026-12-02) was 6.4 GiB above the count without the adapters' matmuls; these add 5.75."""
    p, h, k, f = s.compute_bytes, m.hidden, m.kv_dim, m.ffn
    width = {"q_proj": h, "k_proj": k, "v_proj": k, "o_proj": h, "gate_proj": f, "up_proj": f, "down_proj": h}
    adapted = set(m.adapted) if s.peft != "none" else set()
    if not adapted <= set(width):
        adapted = set()  # another layout (gpt2's c_attn ...): counted as without adapters
    outputs: list[int] = []  # the width of each matmul's output, in order (A's r-wide output as 0)
    for name in LLAMA_LINEARS:
        outputs += [width[name], 0, width[name]] if name in adapted else [width[name]]
    kept = sum(outputs[0::2])  # the 1st, 3rd, ... matmul
    return float(p * (2 * h + kept) + 4 * m.heads)


def _first_gradients_share(m: ModelShape, s: Setting) -> float:
    """The share of the gradients made first in backward: the LM head's (when it trains) and one block's."""
    if s.peft != "none":
        return 1.0 / m.layers
    return ((m.head_params or m.embed_params) + m.block_params) / m.params


def logits_bytes(m: ModelShape, s: Setting) -> float:
    """The LM head's output and the cross-entropy's buffers at the end of forward: (2p + 8) x V bytes per
    token (compute-dtype logits and their shifted copy, the fp32 upcast, log-softmax's fp32 output); with
    Liger's fused loss, its working set instead (fused_loss_bytes)."""
    if s.fused_loss:
        return fused_loss_bytes(m, s)
    return LOGITS_FACTOR * (2 * s.compute_bytes + 8) * m.vocab * s.tokens


def fused_loss_bytes(m: ModelShape, s: Setting) -> float:
    """Liger's fused linear + cross-entropy (liger_kernel/ops/fused_linear_cross_entropy.py) never holds the
    [tokens, V] logits: it walks the tokens in chunks (`model.liger_chunk`; Liger's own: next_pow2(ceil(T /
    ceil(V / h))) rows), each chunk's logits in one compute-dtype buffer its cross-entropy kernel overwrites with
    their gradient (Liger 0.8.5), and keeps the input's gradient (T x h, compute dtype) from forward to backward.
    When the LM head trains it also sums the head's gradient (V x h) over the chunks, in fp32 or the weight's dtype
    (`model.liger_accum`), and casts an fp32 sum to the weight's dtype after the last chunk, its logits buffer
    freed: the peak is the larger of the chunks' (a chunk's logits + the sum) and the cast's (the sum + its copy).
    1B shape, 8192 tokens: 1.2 GiB against 11.7 GiB of logits; measured on one H200, 10.2 GiB less peak; 8192-token
    chunks held 1.47 GiB more than 1024-token ones (7168 more rows of bf16 logits: 1.71 GiB; bench/RESULTS.md
    2026-12-04, seventeenth session); the bf16 sum held 0.734 GiB less than the fp32 one at 1024-token chunks (one
    H100, calls 98 and 100: 6 bytes a head weight at the cast against 2 + a chunk's logits, 0.734 GiB)."""
    from shardtune.models.liger_rules import fused_loss_chunk

    chunk = fused_loss_chunk(s.tokens, m.vocab, m.hidden, s.liger_chunk)[1]
    logits = chunk * m.vocab * s.compute_bytes
    held = s.tokens * m.hidden * s.compute_bytes
    if s.peft != "none":  # a frozen head: no gradient to sum
        return float(logits + held)
    head = m.vocab * m.hidden
    summing = logits + s.head_accum_bytes * head
    casting = (s.head_accum_bytes + s.head_weight_bytes) * head if s.head_accum_bytes != s.head_weight_bytes else 0
    return float(held + max(summing, casting))


def packing_mask_bytes(s: Setting) -> float:
    """A packed batch under sdpa/eager carries a 4-D boolean document mask (s x s per row);
    FlexAttention's block mask and flash-attention's sequence lengths are small."""
    return float(s.micro_batch_size * s.seq_len * s.seq_len) if s.packing and s.attn in ("sdpa", "eager") else 0.0


def model_states(m: ModelShape, s: Setting) -> dict[str, float]:
    """Per-GPU bytes of parameters, gradients and optimizer states, wherever they live (GPU or host),
    before offload moves any of them. Returns the GPU view; offload is applied by `gpu_memory`.

    FSDP2 (ZeRO-2/3, HSDP): fp32 parameters, fp32 gradients and AdamW's two fp32 moments, each sharded
    over the shard group (16 bytes per parameter / shards: the ZeRO paper's K=12 plus 4 for fp32 grads;
    PyTorch keeps them fp32 since the compute dtype is only the gathered copy's). DDP: whole replicas.
    DeepSpeed: compute-dtype parameters (whole below stage 3), and fp32 masters + moments sharded from
    stage 1, gradients from stage 2 (ZeRO, Rajbhandari et al. 2020, section 5).
    LoRA / QLoRA: the frozen base holds no gradient and no optimizer state; its weights are stored in
    peft.base_dtype, or NF4 for the adapted linear layers of QLoRA. Adapters are fp32 masters."""
    pshards, oshards = s.param_shards(), s.optim_shards()
    trainable = m.params if s.peft == "none" else m.lora_params
    per_optim = ADAMW8BIT_BYTES if s.optim == "adamw8bit" else 8.0
    local = 1 if s.frozen_local else pshards  # parallel.shard_frozen: false keeps them whole
    if s.peft == "none":
        frozen = 0.0
    elif s.peft == "qlora":
        frozen = m.target_params * NF4_BYTES / pshards + (m.params - m.target_params) * s.frozen_bytes / local
    elif s.base_float8:  # the adapted layers' weights as their float8 casts, 1 byte each
        frozen = (m.target_params * FLOAT8_BYTES + (m.params - m.target_params) * s.frozen_bytes) / local
    else:
        frozen = m.params * s.frozen_bytes / local
    if s.embedding_on_host(m):  # peft.offload_embedding: the table on the host (host_memory)
        frozen -= m.embed_params * s.frozen_bytes / local
    special = s.rules.model_states(m, s)  # DeepSpeed's full fine-tuning keeps compute-dtype weights + masters
    if special is not None:
        return special
    return {
        "parameters": 4.0 * trainable / pshards + frozen,
        "master_weights": 0.0,
        "gradients": s.gradient_bytes * trainable / pshards,
        "optimizer": per_optim * trainable / oshards,
    }


def gathered_parameters(m: ModelShape, s: Setting) -> float:
    """Unsharded compute-dtype copies alive during forward and backward (bytes), as the backend keeps them
    (plan/backends.py: FSDP2's gathered blocks and root, DDP's autocast cache, DeepSpeed stage 3's prefetch).
    With LoRA the frozen base in the compute dtype is gathered the same way; NF4 weights are dequantised one
    linear layer at a time."""
    if s.frozen_local:
        return 0.0  # the frozen weights are used where they are; FSDP2 gathers the adapters only (MiB)
    return s.rules.gathered_parameters(m, s, gather_sizes(m, s))


def gather_sizes(m: ModelShape, s: Setting) -> tuple[float, float, float]:
    """(elements of the largest weight dequantised at once, bytes of every gathered weight, bytes of the blocks
    FSDP2 holds gathered at once: FSDP2_LIVE_BLOCKS). QLoRA dequantises each NF4 linear into one compute-dtype
    weight at a time, the MLP's the largest, and gathers the rest."""
    p = s.compute_bytes
    if s.peft == "qlora":
        whole = (m.params - m.target_params) * p
        return m.hidden * m.ffn, whole, FSDP2_LIVE_BLOCKS * (m.block_params - m.target_params / m.layers) * p
    return 0.0, m.params * p, FSDP2_LIVE_BLOCKS * m.block_params * p


def comm_buffers(m: ModelShape, s: Setting) -> float:
    """Communication buffers (bytes), as the backend allocates them (plan/backends.py: DeepSpeed's reduce
    buckets, FSDP2's reduce-scatter input, DDP's gradient buckets)."""
    return s.rules.comm_buffers(m, s)


def gpu_memory(m: ModelShape, s: Setting) -> Memory:
    """Peak allocated, reserved and device total per GPU for one setting, with its terms."""
    states = model_states(m, s)
    saved, recompute = activations(m, s)
    saved -= offloaded_activations(m, s)
    returned = offload_returned(m, s)
    gathered = gathered_parameters(m, s)
    transient = backward_transient(m, s)
    offloaded = _offloaded(states, s)
    on_gpu = {k: v for k, v in states.items() if k not in offloaded}
    logits = logits_bytes(m, s)
    buffers = comm_buffers(m, s) + packing_mask_bytes(s)
    # Gradients exist during forward when they accumulate over micro-batches, and under DeepSpeed, whose
    # gradient buffers are allocated once (stage 0-1: the whole model's; stage 3: the partition's flat buffer).
    grads_in_forward = s.grad_accum > 1 or s.rules.gradients_before_backward(s)
    in_backward = {k: v for k, v in on_gpu.items() if k != "fp32_gradients"}  # made by the optimizer step
    base = {k: v for k, v in in_backward.items() if k != "gradients" or grads_in_forward}
    # Backward frees each block's activations as it makes that block's gradients, so its peak is at one end:
    # at the start every activation is alive with the LM head's gradient and the last block's; at the end
    # every gradient with the first block's activations (kept, or recomputed under checkpointing).
    first = {**base, "gradients": in_backward.get("gradients", 0.0) * _first_gradients_share(m, s)} \
        if "gradients" in in_backward and not grads_in_forward else dict(in_backward)
    # peft.offload_head: the head is on the GPU from a forward's start to its loss (Liger's fused loss), or to its
    # own backward, the first to run (a plain loss saves it for that)
    lent = host_head_bytes(m, s)
    start_saved, start_recompute, start_transient = _backward_start(m, s, saved, recompute, transient)
    # the final norm's saved tensors, alive at forward's end (their backward runs first; the offload moves them)
    norm = 0.0 if norm_offloaded(m, s) else final_norm_bytes(m, s)
    phases = {
        "forward end": {**base, "gathered_parameters": gathered, "activations": saved + norm, "logits": logits,
                        "buffers": buffers},
        "backward start": {**_less_parameters(first, lent if s.fused_loss else 0.0), "gathered_parameters":
                           gathered, "activations": start_saved + start_recompute + returned,
                           "backward_transient": start_transient, "buffers": buffers},
        "backward end": {**_less_parameters(in_backward, lent), "gathered_parameters": gathered,
                         "activations": (recompute or saved / m.layers) + returned, "backward_transient": transient,
                         "buffers": buffers},
        "optimizer": _less_parameters(on_gpu, lent),
    }
    # (peft.base_dtype: float8 loads each adapted weight in the compute dtype and keeps its cast: one weight's
    # compute-dtype copy at a time, under 0.2 GiB on the 8B shape, before any activation exists.)
    phase, terms = max(phases.items(), key=lambda kv: sum(kv[1].values()))
    terms = {k: float(v) for k, v in terms.items() if v}
    allocated = sum(terms.values())
    # A recompute inside the compiled backward runs in Inductor's planned buffers: the 1B at budget 0.5 reserved
    # 1.018 x its allocated (call 93), not the eager recompute's share more.
    eager_recompute = recompute and not s.recompute_compiled
    frag = PEFT_FRAGMENTATION if s.peft != "none" else \
        (DIRECT_FRAGMENTATION if s.one_gpu_direct else FRAGMENTATION) + (RECOMPUTE_FRAGMENTATION if eager_recompute
                                                                         else 0.0)
    if s.mlp_tiled:
        cached = (TILED_CACHED_COMPILED if s.compile else TILED_CACHED) * m.hidden * s.tokens
    else:
        cached = CACHED_TRANSIENTS * m.ffn * s.tokens
    reserved = max(allocated * (1 + frag), allocated + cached * s.compute_bytes)
    context = CUDA_CONTEXT + (NCCL_BUFFERS if s.world > 1 else 0.0) + (COMPILE_WORKSPACE if s.compile else 0.0)
    return Memory(terms=terms, phase=phase, allocated=allocated, reserved=reserved, total=reserved + context,
                  host=host_memory(m, s, states, offloaded))


def _backward_start(m: ModelShape, s: Setting, saved: float, recompute: float,
                    transient: float) -> tuple[float, float, float]:
    """(saved, recomputed, transient) bytes at backward's largest point near its start. Under
    parallel.checkpoint_blocks the last blocks keep their activations, so backward starts without a recompute;
    the first recompute (block N-1's) comes once their activations are freed, with the N blocks' inputs alive:
    the larger of the two. 8B LoRA with 31 of 32 blocks checkpointed peaked at 16.96 GiB against the defaults'
    16.98 (call 134), where backward's start alone said 16.22. With parallel.activation_offload the N inputs are
    on the host (one comes back at a time, as under full checkpointing of every block)."""
    if not s.blocks_left_out(m.layers):
        return saved, recompute, transient
    taken = s.checkpointed_layers(m.layers)
    kept_start = (saved, 0.0, backward_transient(m, s.replace(activation_checkpointing="none")))
    first_recompute = (float(taken * s.compute_bytes * m.hidden * s.tokens) - offloaded_activations(m, s), recompute,
                       transient)
    return max(kept_start, first_recompute, key=sum)


def host_head_bytes(m: ModelShape, s: Setting) -> float:
    """Bytes of the frozen LM head peft.offload_head keeps on the host between forwards (on the direct path: whole)."""
    return float(m.head_params * s.frozen_bytes) if s.head_on_host(m) else 0.0


def _less_parameters(states: dict[str, float], lent: float) -> dict[str, float]:
    """`states` without `lent` bytes of parameters (a weight on the host in this phase)."""
    return {**states, "parameters": states["parameters"] - lent} if lent else dict(states)


def _offloaded(states: dict[str, float], s: Setting) -> set[str]:
    """DeepSpeed ZeRO-Offload moves the optimizer states, fp32 masters and their gradients to the host
    (optimizer), and the parameters too (params)."""
    if s.offload == "none":
        return set()
    # The compute-dtype gradients stream to the host bucket by bucket instead of filling a GPU partition.
    moved = {"optimizer", "master_weights", "fp32_gradients", "gradients"}
    return moved | {"parameters"} if s.offload == "params" else moved


def host_memory(m: ModelShape, s: Setting, states: dict[str, float], offloaded: set[str]) -> dict[str, float]:
    """Host memory per node (bytes): the processes themselves, offloaded states (pinned; on NVMe only
    DeepSpeed's swap buffers stay in memory), and an async checkpoint's staging copy, which is kept for
    the whole run: the node's share of the checkpoint (fp32 trainable parameters + optimizer states)."""
    host = {"processes": PROCESS_HOST * s.per_node}
    if offloaded:
        moved = sum(states.get(k, 0.0) for k in offloaded if k != "gradients") * s.per_node
        # DeepSpeed keeps each partition's compute-dtype copy for the upload and pinned fp32 staging of its
        # gradients on the host besides the states: (p + 4) bytes per parameter of the partition (measured
        # 24.7 GiB over the processes' own for the 1B shape, 18.5 GiB of states).
        trainable = m.params if s.peft == "none" else m.lora_params
        moved += (s.compute_bytes + 4.0) * trainable / s.world * s.per_node
        host["offload"] = min(moved, 2 * 5e8 * 4 * s.per_node) if s.nvme else moved
    if s.embedding_on_host(m):  # peft.offload_embedding's table, pageable, in each process
        host["embedding"] = m.embed_params * s.frozen_bytes * s.per_node
    if s.head_on_host(m):  # peft.offload_head's pinned copy, in each process
        host["head"] = host_head_bytes(m, s) * s.per_node
    if s.activation_offload:  # pinned copies of one micro-batch's
        norm = final_norm_bytes(m, s) if norm_offloaded(m, s) else 0.0
        host["activations"] = (offloaded_activations(m, s) + norm) * s.per_node
    if s.async_checkpoint:
        trainable = m.params if s.peft == "none" else m.lora_params
        per_param = 4.0 + (ADAMW8BIT_BYTES if s.optim == "adamw8bit" else 8.0)
        host["checkpoint_staging"] = per_param * trainable / s.world * s.per_node
    return host
