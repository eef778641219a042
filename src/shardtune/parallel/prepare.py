"""What every backend does to the model before sharding it, in the fixed order: activation
checkpointing, then torch.compile of each decoder block (adapters are already in place).

`parallel.activation_checkpointing`:
- full: each decoder block keeps only its input; backward runs the block's forward again.
- selective: per-op selective checkpointing as torchtitan's `selective_ac_option: op` does: the block keeps the
  outputs of its attention kernel and of every other matmul (q, v, gate and down projections: the first, third,
  ... of the block), and recomputes the rest (k, o and up projections, norms, RoPE, SiLU) in backward. About a
  third of a block's forward matmul FLOPs are recomputed instead of all of them, for about a third of the
  activations of no checkpointing (plan/memory.py, plan/speed.py).
"""

from __future__ import annotations

import types
import weakref
from collections import defaultdict, deque
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardtune.config import ParallelConfig
from shardtune.parallel import checkpoint_traced
from shardtune.parallel.tiled_mlp import tile_mlps

# Ops whose outputs selective checkpointing saves (torchtitan's _save_list for one device: matmuls, the attention
# kernels). Every other matmul is recomputed, which halves what the matmul outputs cost in memory.
_aten = torch.ops.aten
SAVED_OPS = {_aten.mm.default, _aten._scaled_dot_product_efficient_attention.default,
             _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_cudnn_attention.default,
             _aten._scaled_dot_product_flash_attention_for_cpu.default}


def selective_policy(counts: dict[str, int]) -> Any:
    """The per-op policy of one checkpointed call: save the attention kernel's output and every other matmul's
    (the 1st, 3rd, ...: counted separately in forward and in the recompute, so both make the same choices), and
    recompute the rest: MUST_RECOMPUTE, not torchtitan's PREFER_RECOMPUTE, so that compile's partitioner keeps
    what is priced (recompute_all_context)."""
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = "recompute" if ctx.is_recompute else "forward"
        if func == _aten.mm.default:
            counts[key] += 1
            save = counts[key] % 2 == 1
        else:
            save = func in SAVED_OPS
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.MUST_RECOMPUTE

    return policy


def selective_context() -> Any:
    """torch.utils.checkpoint's context_fn for one checkpointed call (a fresh matmul count each call)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_policy(defaultdict(int)))


def recompute_all_context() -> Any:
    """context_fn of full checkpointing traced by compile: every op MUST_RECOMPUTE. Without it compile takes a
    checkpoint's ops as PREFER_RECOMPUTE, a hint its partitioner may override: 8B LoRA in float8 on one H100 then
    kept matmul outputs, 22.1 GiB at micro-batch 2 against 10.9 around the compiled blocks (twenty-seventh
    session, call 78), which is not what `full` promises nor what the planner prices."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(lambda *_args, **_kw: CheckpointPolicy.MUST_RECOMPUTE)


def checkpoint_kwargs(mode: str, traced: bool = False) -> dict[str, Any]:
    """Keyword arguments for torch.utils.checkpoint.checkpoint (CheckpointedForward).
    Non-reentrant checkpointing composes with FSDP2, DeepSpeed and compile; it keeps parameter names. `traced`:
    the checkpoint is inside compiled code (recompute_all_context for full)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = selective_context
    elif mode == "full" and traced:
        kwargs["context_fn"] = recompute_all_context
    return kwargs


# Saved tensors below this size stay on the device: their copies would cost more in latency than they free.
OFFLOAD_MIN_BYTES = 1 << 20
# Saved tensors whose copies out may still run when the next is saved (ActivationOffload.in_flight). One: under
# full checkpointing each block saves one input, whose copy then runs under that block's forward and is waited
# for where the next block starts, about when the input would be freed anyway, so the held tensors add no memory
# (8B at 327,680 tokens: a 2.5 GiB block input, ~50 ms over PCIe, under a ~3 s block forward). More would overlap
# more only where saves come faster than PCIe, and hold one more such tensor each (torchtune's default is 5).
IN_FLIGHT = 1
# Bytes of copies back (ActivationOffload's backward) the host may queue ahead of the GPU (bound_copies_back).
BACK_BYTES = 1 << 30


def power_of_two_pieces(count: int, smallest: int) -> list[int]:
    """`count` split into powers of two, largest first, the remainder under `smallest` as one last piece.
    torch's pinned-memory allocator rounds every request up to a power of two and keeps the block: a 2.5 GiB
    block input (327,680 tokens of the 8B shape) would hold 4 GiB of pinned host memory, 128 GiB over 32 layers;
    in pieces it holds what it stores (2 GiB + 512 MiB)."""
    pieces = [1 << bit for bit in reversed(range(count.bit_length())) if count >> bit & 1 and 1 << bit >= smallest]
    if count > sum(pieces):
        pieces.append(count - sum(pieces))
    return pieces


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved activations copied to host memory in forward (pinned on GPUs) and back in backward, as torch's
    save_on_cpu does, but only activations: parameters and their views (FSDP2's gathered weights, transposed,
    that a matmul saves) and tensors under `min_bytes` stay where they are; and each copy is made of
    power-of-two pieces (power_of_two_pieces: pinned blocks are not rounded up). A tensor saved again, unchanged,
    while the hooks are on is copied once: every block saves the same RoPE cos and sin (5 GiB over 32 layers of
    the 8B shape at 327,680 tokens, were each copied). `moved_bytes` counts what went to the host since it was
    made.

    On GPUs both copies run on a side stream, overlapped with compute (as torchtune's OffloadActivations): the
    copy out waits only for the kernel that made the tensor, and the host goes on (save_on_cpu's copy blocks the
    host until the GPU has caught up, so the GPU's queue drains at every saved tensor); the copy back starts when
    backward asks for the tensor, alongside the kernels still queued, and the compute stream waits for it just
    before its first use. A tensor being copied out is kept (`in_flight`) until the compute stream has been made
    to wait for its copy, once IN_FLIGHT later saved tensors are queued and at the decoder's forward end (settle):
    then its memory goes back to the compute stream's pool at once, and the copies in flight, and the memory they
    hold, stay bounded even where the forward makes saved tensors faster than PCIe moves them (torchtune's
    max_fwd_stash_size). The copy back's tensor comes from the side stream's pool; record_stream holds it until
    the compute stream's work on it has run, and the host waits for the GPU where more than BACK_BYTES of them
    would be held at once. `overlap=False` copies as save_on_cpu does (bench/probe_offload.py's
    baseline). Saved tensors are not modified in place later (autograd would refuse it without the hooks); a
    model that did would now race the copy."""

    def __init__(self, device_type: str, min_bytes: int = OFFLOAD_MIN_BYTES, overlap: bool = True) -> None:
        self.moved_bytes = 0
        self.copies: dict[int, tuple[weakref.ref, int, Any]] = {}  # id(tensor) -> (the tensor, its version, copy)
        self.streams: dict[torch.device, Any] = {}  # device -> its side stream for the copies (CUDA)
        self.in_flight: deque[tuple[torch.Tensor, Any, Any]] = deque()  # (GPU tensor, copy's event, its compute)
        self.coming_back: deque[tuple[Any, int]] = deque()  # (compute stream's event at an unpack, its bytes)
        pin = device_type == "cuda"

        def side_stream(device: torch.device) -> Any:
            if device not in self.streams:
                self.streams[device] = torch.cuda.Stream(device)
            return self.streams[device]

        def pack(tensor: torch.Tensor) -> tuple[bool, Any]:
            if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
                return False, tensor
            compact = unbroadcast(tensor)
            size = compact.numel() * compact.element_size()
            if size < min_bytes:
                return False, tensor
            seen = self.copies.get(id(tensor))
            if seen is not None and seen[0]() is tensor and seen[1] == tensor._version:
                return True, seen[2]
            self.moved_bytes += size
            flat = memory_order(compact)
            dense = flat is not None
            if flat is None:
                flat = compact.detach().reshape(-1)
            if overlap and pin and tensor.is_cuda:
                side = side_stream(tensor.device)
                compute = torch.cuda.current_stream(tensor.device)
                side.wait_stream(compute)  # the kernels that made it, no more
                with torch.cuda.stream(side):
                    pieces = copy_out(flat, non_blocking=True)
                self.in_flight.append((flat, side.record_event(), compute))
                while len(self.in_flight) > IN_FLIGHT:
                    self.settle(1)
            else:
                pieces = copy_out(flat, non_blocking=False)
            layout = (compact.shape, compact.stride(), dense, tensor.shape)
            self.copies[id(tensor)] = (weakref.ref(tensor), tensor._version, (tensor.device, layout,
                                                                               tensor.dtype, pieces))
            return True, self.copies[id(tensor)][2]

        def copy_out(flat: torch.Tensor, non_blocking: bool) -> list[torch.Tensor]:
            pieces, start = [], 0
            for count in power_of_two_pieces(flat.numel(), max(1, OFFLOAD_MIN_BYTES // flat.element_size())):
                piece = torch.empty(count, dtype=flat.dtype, pin_memory=pin)
                piece.copy_(flat[start:start + count], non_blocking=non_blocking)
                pieces.append(piece)
                start += count
            return pieces

        def unpack(packed: tuple[bool, Any]) -> torch.Tensor:
            moved, value = packed
            if not moved:
                return value
            device, layout, dtype, pieces = value
            numel = sum(p.numel() for p in pieces)
            if not (overlap and pin and device.type == "cuda"):
                return with_layout(copy_in(torch.empty(numel, dtype=dtype, device=device), pieces), *layout)
            compute, side = torch.cuda.current_stream(device), side_stream(device)
            with torch.cuda.stream(side):  # after the copy out on the same stream
                out = copy_in(torch.empty(numel, dtype=dtype, device=device), pieces)
            compute.wait_stream(side)
            out.record_stream(compute)  # made on the side stream, used and freed on the compute stream
            bound_copies_back(compute, out.numel() * out.element_size())
            return with_layout(out, *layout)

        def bound_copies_back(compute: Any, size: int) -> None:
            """A copy back's memory comes from the side stream's pool and is reusable only once the GPU has run
            past its last use (record_stream), so the host running ahead through backward would hold one per
            block it has queued. Past BACK_BYTES of them the host waits for the GPU to reach the oldest's unpack:
            with 2.5 GiB block inputs (8B, 327,680 tokens) it stays about one block ahead, which keeps the GPU's
            queue full; with smaller tensors it may run further ahead."""
            self.coming_back.append((compute.record_event(), size))
            while len(self.coming_back) > 1 and sum(b for _, b in self.coming_back) > BACK_BYTES:
                self.coming_back.popleft()[0].synchronize()

        def copy_in(out: torch.Tensor, pieces: list[torch.Tensor]) -> torch.Tensor:
            start = 0
            for piece in pieces:
                out[start:start + piece.numel()].copy_(piece, non_blocking=pin)
                start += piece.numel()
            return out

        super().__init__(pack, unpack)

    def settle(self, count: int | None = None) -> None:
        """The compute stream waits for the oldest `count` copies out in flight (all by default), and their GPU
        tensors go: their memory is reused in the compute stream's order, after the copies."""
        for _ in range(len(self.in_flight) if count is None else min(count, len(self.in_flight))):
            _tensor, copied, compute = self.in_flight.popleft()
            compute.wait_event(copied)


def unbroadcast(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor with each broadcast dimension (stride 0, e.g. an attention bias expanded over the heads)
    narrowed to one element: what is copied, once; the copy back is expanded again."""
    for dim, (stride, size) in enumerate(zip(tensor.stride(), tensor.shape, strict=True)):
        if stride == 0 and size > 1:
            tensor = tensor.narrow(dim, 0, 1)
    return tensor


def memory_order(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor's elements as a 1-D view in memory order, where they fill their span with no gap (a contiguous
    tensor or a permutation of one, e.g. a transposed operand); None otherwise."""
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(tensor.stride(), tensor.shape, strict=True) if n > 1):
        if stride != expected:
            return None
        expected *= size
    return tensor.detach().as_strided((tensor.numel(),), (1,), tensor.storage_offset())


def with_layout(flat: torch.Tensor, shape: torch.Size, stride: tuple[int, ...], dense: bool,
                full_shape: torch.Size) -> torch.Tensor:
    """A copied-back tensor as it was saved: a dense one with its strides (a compiled backward checks them,
    Inductor's assert_size_stride), broadcast dimensions expanded again. One with gaps (a slice of a fused
    projection) comes back contiguous, at its own size rather than its span's: the saved tensors the hooks see
    are eager ops' (parallel.check_combination: no offload where compile traces the checkpoint)."""
    restored = flat.as_strided(shape, stride) if dense else flat.view(shape)
    return restored.expand(full_shape)


def offload_activations(model: nn.Module, blocks: list[nn.Module], device_type: str,
                        min_bytes: int = OFFLOAD_MIN_BYTES, overlap: bool = True,
                        until: nn.Module | None = None) -> ActivationOffload:
    """parallel.activation_offload: the offload hooks are on while the decoder (the module holding the blocks)
    runs its forward, so the blocks' saved tensors go to the host, and with full checkpointing the blocks'
    inputs, which non-reentrant checkpointing saves through autograd before its own hooks take over. The LM
    head and the loss stay outside: their tensors are needed at once in backward (the logits are the largest).
    `until`, a block: the hooks go off as it starts (parallel.checkpoint_blocks: the blocks left out of the
    checkpoint keep their activations on the GPU, where backward reads them first, and the final norm's too)."""
    decoder = next(m for m in model.modules()
                   if any(isinstance(c, nn.ModuleList) and any(b is blocks[0] for b in c) for c in m.children()))
    offload = ActivationOffload(device_type, min_bytes, overlap)
    on = [False]

    def start(*_: Any) -> None:  # a pre-hook's return value would replace the forward's arguments
        offload.coming_back.clear()  # the last backward's: run by now
        offload.__enter__()
        on[0] = True

    # a hook on a compiled block runs inside its compiled call: Dynamo breaks the graph there (the saved-tensor
    # hooks' stack is not traced) and resumes with the block's forward, one block in the run
    @torch.compiler.disable
    def pause(*_: Any) -> None:
        if on[0]:
            offload.__exit__(None, None, None)
            on[0] = False

    def stop(*_: Any) -> None:  # the graph holds the copies; the table of them is only for this forward
        pause()
        offload.copies.clear()
        offload.settle()

    decoder.register_forward_pre_hook(start)
    decoder.register_forward_hook(stop, always_call=True)
    if until is not None:
        until.register_forward_pre_hook(pause)
    return offload


def checkpointed_count(blocks: list[nn.Module], parallel: ParallelConfig) -> int:
    """How many of the first blocks full checkpointing takes: all, or parallel.checkpoint_blocks of them."""
    return len(blocks) if parallel.checkpoint_blocks is None else min(parallel.checkpoint_blocks, len(blocks))


def first_left_out(blocks: list[nn.Module], parallel: ParallelConfig) -> nn.Module | None:
    """The first block parallel.checkpoint_blocks leaves out of full checkpointing; None where it leaves none."""
    count = checkpointed_count(blocks, parallel)
    return blocks[count] if count < len(blocks) else None


def checkpoint_and_compile(model: nn.Module, blocks: list[nn.Module], parallel: ParallelConfig,
                           device_type: str = "cpu") -> ActivationOffload | None:
    """Checkpointing, then compile of each block; with parallel.activation_offload the offload hooks (returned).
    Every block (the first parallel.checkpoint_blocks where set) is checkpointed here as CheckpointedForward, the
    same way on every transformers release and whether compiled or not (transformers' own per-block checkpointing
    wraps `__call__` up to 5.18, its hooks inside the checkpoint, and `forward` in newer ones, 5.25): eager, around
    the block's forward; compiled, around the compiled forward (the recompute runs it again from Python:
    parallel.checkpoint_in_compile false, or auto with activation offload) or inside it (the compiled backward
    recomputes; the default, and always for selective: parallel.checkpoint_traced). The block's hooks (FSDP2's,
    DeepSpeed's) stay outside the checkpoint, as torchtitan's checkpoint wrapper keeps them."""
    last = checkpointed_count(blocks, parallel)
    offload = None
    if parallel.activation_offload:  # the checkpointed blocks' inputs (all saved tensors without a checkpoint)
        offload = offload_activations(model, blocks, device_type, until=first_left_out(blocks, parallel))
    mode, traced = parallel.activation_checkpointing, checkpoint_traced(parallel)
    if parallel.compile:
        set_memory_budget(parallel.activation_memory_budget)
    if traced:
        allow_side_effects_under_checkpoint()
    kwargs, compile_kw = checkpoint_kwargs(mode, traced), compile_kwargs(parallel)
    compiled_around = parallel.compile and mode != "none" and not traced
    if parallel.compile:
        one_graph_for_every_block(model)
    if parallel.tiled_mlp is not None:  # before the checkpoint and compile take each block's forward
        tile_mlps(blocks, parallel.tiled_mlp)
    for index, block in enumerate(blocks):
        checkpointed = mode != "none" and index < last  # parallel.checkpoint_blocks: the first N only
        if checkpointed:
            block.forward = CheckpointedForward(block, kwargs, compile_kw if compiled_around else None)
        if parallel.compile and not (checkpointed and compiled_around):
            block.compile(**compile_kw)
    return offload


def one_graph_for_every_block(model: nn.Module) -> None:
    """Have the input embedding's output require grad where the embedding is frozen (LoRA, QLoRA), as transformers'
    `enable_input_require_grads` does, but not as a leaf (_RequiresGrad). Dynamo guards on whether a block's input
    requires grad: the first block's came without, every other block's with, so each run compiled the block twice
    (one block's compile: ~6 s of the 8B QLoRA's first step on an H100, 1.6 s of a micro CPU run). The price is
    the first block's input gradient, its q / k / v input gradients: 0.1% of the 8B's backward."""
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    if isinstance(embed, nn.Module):
        embed.register_forward_hook(_output_requires_grad)


class _RequiresGrad(torch.autograd.Function):
    """Its input, as an output that requires grad and is no leaf: the gradient reaching it (the first block's
    input gradient) goes nowhere, the embedding being frozen. `requires_grad_` made the output a leaf, which its
    AccumulateGrad node holds until backward, beside the copy the activation offload made of it on the host (the
    first block's input: 32 MiB on the 8B shape at 4,096 tokens, 2.5 GiB at 327,680; bench/RESULTS.md
    forty-sixth session, call 142's probe), and which got a `.grad` no one read at backward's end. The output
    shares the input's memory (`detach`: no view, so in-place use stays allowed)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        return None, None


# _RequiresGrad's input that requires grad; it never gets a gradient
_ANCHOR = torch.zeros((), requires_grad=True)


def _output_requires_grad(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor | None:
    if torch.is_grad_enabled() and not output.requires_grad:  # not in evaluation (no_grad)
        return _RequiresGrad.apply(output, _ANCHOR)
    return None


# A decoder block's KV-cache arguments across transformers' releases and models.
CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


class CheckpointedForward:
    """A block's `forward` under torch.utils.checkpoint where a backward will recompute it (training, with
    gradients: as transformers' per-block checkpointing; evaluation runs it as is). Held as the block's `forward`
    attribute; it names its block as an attribute, not in a closure, so a deep copy of the model checkpoints each
    copied block's own forward (a closure over the original block's bound forward had the copy compute with the
    original's weights and send its gradients there). `compile_kw`: the checkpoint around `torch.compile` of the
    forward (made on first use: a copy compiles its own), so the recompute runs the compiled forward again from
    Python (what transformers up to 5.18 does with a compiled block; the GPU numbers before the twenty-seventh
    session). None: the class's forward, inside the block's own compile, which traces the checkpoint into a
    higher-order op so the compiled backward recomputes the block itself (torchtitan's order: checkpoint, then
    compile; the block's parameter names stay as they are, no wrapper module)."""

    def __init__(self, block: nn.Module, kwargs: dict[str, Any], compile_kw: dict[str, Any] | None = None):
        self.block, self.kwargs, self.compile_kw = block, kwargs, compile_kw
        self.function = type(block).forward
        self.compiled: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "compiled": None}  # compiled code is the original block's: a copy compiles again

    def __call__(self, *args: Any, **kw: Any) -> Any:
        if self.compile_kw is None:
            forward, args = self.function, (self.block, *args)
        else:
            if self.compiled is None:
                self.compiled = torch.compile(types.MethodType(self.function, self.block), **self.compile_kw)
            forward = self.compiled
        if not (self.block.training and torch.is_grad_enabled()):
            return forward(*args, **kw)
        # no KV cache under checkpointing (as transformers): the recompute would read the one the forward wrote
        kw.update({k: None for k in CACHE_KWARGS if kw.get(k) is not None})
        if kw.get("use_cache"):
            kw["use_cache"] = False
        return checkpoint(forward, *args, **self.kwargs, **kw)


def allow_side_effects_under_checkpoint() -> None:
    """Let Dynamo trace a checkpoint whose forward has a side effect. transformers' output capturing sets a
    context variable in each block's forward; inside a checkpoint Dynamo refuses that (a graph break that leaves
    the whole block eager, silently) unless told the recompute need not replay it. Eager's recompute runs after
    the forward has reset the variable, so replaying it changes nothing either. (A process-wide setting: one
    training process prepares one model.)"""
    import torch._dynamo

    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def set_memory_budget(budget: float | None) -> None:
    """parallel.activation_memory_budget for the blocks compiled next. torch reads it when it partitions a compiled
    forward and its backward (at the first call), from one process-wide setting (torch 2.11 has no per-graph
    form), so it covers every compiled graph of the run, and each prepare sets it: torch's default (1.0) where
    unset. Its value is part of AOTAutograd's cache key but not of Dynamo's guards: a block compiled earlier in
    this process under another value would be reused with that one's partition (the GPU test's three models in
    one process kept the same bytes), so a change of value resets torch.compile's caches first."""
    import torch._functorch.config as functorch_config

    value = 1.0 if budget is None else float(budget)
    if functorch_config.activation_memory_budget != value:
        torch.compiler.reset()
    functorch_config.activation_memory_budget = value


def compile_kwargs(parallel: ParallelConfig) -> dict[str, Any]:
    """torch.compile's arguments for each block: parallel.compile_mode or parallel.compile_options (not both)."""
    if parallel.compile_options:
        return {"options": dict(parallel.compile_options)}
    return {"mode": parallel.compile_mode} if parallel.compile_mode != "default" else {}
