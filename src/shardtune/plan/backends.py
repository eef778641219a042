"""The planner's model of each backend: how it stores, gathers, buffers and communicates what the generic
terms of plan/memory.py and plan/speed.py count, one class per `parallel.backend`. The formulas and
constants elsewhere in plan/ hold for any backend; what differs between engines lives here, reached through
`Setting.rules` (`RULES[setting.backend]`), so plan/ tests no backend by name (DESIGN.md's seam). What each
backend runs (strategies, offload, refusals) stays declared in its own module under parallel/."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardtune.plan.setting import Setting
    from shardtune.plan.shape import ModelShape

# DeepSpeed's reduce bucket (reduce_bucket_size, elements) and stage 3's prefetch (stage3_prefetch_bucket_size).
DS_REDUCE_BUCKET = 5e8
DS_PREFETCH_BUCKET = 5e7
# DeepSpeed's engine against FSDP2 on the same work, one H200 (zero2: 0.92x, measured with overlap_comm off
# on one GPU; zero3: 0.71x).
DEEPSPEED_EFF = {"ddp": 0.92, "zero1": 0.92, "zero2": 0.92, "zero3": 0.71}
# DDP runs mixed precision through autocast, which casts weights every forward (measured 0.95x of zero2).
AUTOCAST_EFF = 0.95
# parallel.one_gpu: direct against FSDP2 on a mesh of one, the same work (1B full fine-tuning on one H200,
# bench/RESULTS.md 2026-12-04, seventeenth session): 1.036x and 1.036x (calls 42, 43), 1.07x at 1024-token
# fused-loss chunks (call 45, FSDP2's spread 46-57k). The copies FSDP2 still makes on one process (the cast into
# and out of its gather buffer, the fp32 reduce-scatter input and its one-rank copy: ~15 ms of a 160 ms step in
# call 43's profile against ~11 of the direct path's casts) and its optimizer over DTensors; the rate of the lower.
DIRECT_EFF = 1.04
# The compiled update where backward leaves the gradients in the compute dtype (one micro-batch a step, full
# fine-tuning; Setting.gradient_bytes): no cast of each gradient into an fp32 master during backward (a kernel and an
# allocation per parameter from a Python hook). speed.optimizer_bytes credits the update's own bytes (+1.2% on the
# 1B shape); measured +5.3% and +5.1% on one H100 (calls 87, 88): the rest, fitted on those two.
COMPILED_UPDATE_EFF = 1.04


class Fsdp2Rules:
    """PyTorch FSDP2 (zero2 / zero3 / hsdp: fully_shard per decoder block) and DDP with autocast (ddp)."""

    name = "fsdp2"
    keeps_deepspeed_section = False
    has_one_gpu_direct = True  # parallel.one_gpu: direct (zero2 / zero3 on one process without FSDP2)

    def param_shards(self, s: Setting) -> int:
        """Processes that share one copy of the parameters (1: each holds them whole)."""
        if s.strategy in ("zero2", "zero3"):
            return s.world
        if s.strategy == "hsdp":
            return s.shard_size or s.per_node
        return 1

    def optim_shards(self, s: Setting) -> int:
        """Processes that share one copy of the optimizer states and fp32 masters."""
        return self.param_shards(s)

    def keeps_frozen_local(self, s: Setting) -> bool:
        """parallel.shard_frozen: false can apply (fully_shard's ignored_params; DDP holds everything whole)."""
        return s.strategy != "ddp"

    def shard_group(self, s: Setting) -> int:
        """The processes one collective spans (hsdp: its shard group; the rest: every process)."""
        return self.param_shards(s) if s.strategy == "hsdp" else s.world

    def residual_bytes(self, m: ModelShape, s: Setting) -> float:
        """Extra saved bytes per token and block: DDP's autocast leaves the residual stream in fp32 (the fp32
        embedding's output), so each norm keeps an fp32 normalised copy instead of a compute-dtype one
        (+2 x (4 - p)h)."""
        p = s.compute_bytes
        return 2.0 * (4 - p) * m.hidden if s.strategy == "ddp" and p != 4 else 0.0

    def model_states(self, m: ModelShape, s: Setting) -> dict[str, float] | None:
        """None: the generic fp32 parameters / gradients / moments of memory.model_states."""
        return None

    def gathered_parameters(self, m: ModelShape, s: Setting, sizes: tuple[float, float, float]) -> float:
        """Unsharded compute-dtype copies alive during forward and backward; `sizes`: memory.gather_sizes.

        zero2 keeps every block gathered from its forward to its backward (the whole model); zero3 / hsdp keep
        the root (embedding, head, norm: not resharded after forward) and two blocks (the one computing and the
        one prefetched). DDP runs under autocast, whose cast cache keeps a compute-dtype copy of every weight
        from forward to backward. With fp32 compute and no sharding nothing is copied.
        A mesh of one with a PEFT base in the compute dtype keeps no gathered block at the peak, but the root's
        gathered copy (embedding, head) is alive while a fused loss runs: the fused loss runs inside the root's
        forward (models/liger.install_fused_loss), the plain loss after it, once the root has resharded."""
        p = s.compute_bytes
        largest, whole, blocks = sizes
        if s.one_gpu_direct:  # parallel.one_gpu: direct: compute-dtype copies of the trained weights, kept;
            # LoRA's matrices cast in their forward instead (parallel/direct_engine.CastLinear; 8B LoRA's peak on
            # one H200 was FSDP2's to 0.1 MB, bench/RESULTS.md call 50)
            return 0.0 if p == 4 or s.peft != "none" else m.params * p
        if self.param_shards(s) == 1 and s.strategy != "ddp" and s.peft != "none" and s.frozen_bytes == p:
            # Measured on one H200 (8B LoRA and 8B / 70B QLoRA, zero3): without Liger nothing gathered at the
            # peak; with its fused loss, FSDP2's all-gather outputs of the root (3 tensors, 2,004 MiB on the 8B
            # shape) are alive at it (log.memory_snapshot of 8B LoRA / QLoRA + Liger, bench/RESULTS.md 2026-12-02,
            # third session). zero2 keeps each block's gathered frozen base from its forward to its backward: 8B
            # LoRA zero2 measured 13.1 GiB above this count without it (micro-batch 2; the blocks' bf16 base is
            # 13.0 GiB, bench/RESULTS.md 2026-12-04). NF4 blocks are not gathered (FSDP2 ignores them).
            root = float(m.root_params * p) if s.fused_loss else 0.0
            if s.strategy == "zero2" and s.peft != "qlora":
                return root + (m.params - m.root_params) * p
            return root
        if s.strategy == "ddp":
            return 0.0 if p == 4 or s.peft != "none" else whole
        if s.strategy == "zero2":
            return whole + largest * p
        return m.root_params * p + blocks + largest * p

    def comm_buffers(self, m: ModelShape, s: Setting) -> float:
        """FSDP2's reduce-scatter input (one block's unsharded fp32 gradients while it is reduced); DDP's
        reducer keeps fp32 gradient buckets as large as the trainable parameters (not the gradients' storage:
        gradient_as_bucket_view is off), even in a group of one."""
        if s.strategy == "ddp":
            return 4.0 * (m.params if s.peft == "none" else m.lora_params)
        if s.world == 1:
            return 0.0
        return 4.0 * (m.block_params if s.peft == "none" else m.lora_params / m.layers)

    def gradients_before_backward(self, s: Setting) -> bool:
        """Whether gradient storage exists during forward even without accumulation (no: made in backward)."""
        return False

    def efficiency(self, s: Setting) -> float:
        """This engine's rate against FSDP2 on the same work: DDP's autocast casts weights every forward; the
        one-process path without FSDP2 skips FSDP2's copies."""
        if s.one_gpu_direct:
            return DIRECT_EFF * (COMPILED_UPDATE_EFF if s.bf16_gradients_updated else 1.0)
        return AUTOCAST_EFF if s.strategy == "ddp" and s.precision != "fp32" else 1.0

    def comm_bytes(self, m: ModelShape, s: Setting, gathered: float, last_block: float) -> dict[str, float]:
        """Bus bytes per step: zero3 / hsdp gather the parameters twice per micro-batch (forward and backward)
        except the last decoder block, which parallel/fsdp2_engine.py keeps gathered from forward to backward;
        zero2 gathers everything once; every sharded strategy reduce-scatters fp32 gradients per micro-batch;
        DDP all-reduces once per step; hsdp adds an all-reduce of the sharded gradients across its replica
        groups."""
        w = s.world
        trainable = m.params if s.peft == "none" else m.lora_params
        if s.strategy == "ddp":
            return {"all_reduce": 2 * trainable * 4.0 * (w - 1) / w}
        n = self.param_shards(s)
        regathered = 0.0 if s.strategy == "zero2" else gathered - last_block
        out = {"all_gather": (gathered + regathered) * (n - 1) / n * s.grad_accum,
               "reduce_scatter": trainable * 4.0 * (n - 1) / n * s.grad_accum}
        replicas = w // n
        if replicas > 1:
            out["all_reduce"] = 2 * trainable * 4.0 / n * (replicas - 1) / replicas
        return out

    def copy_bytes(self, m: ModelShape, s: Setting) -> float:
        """HBM bytes per step its copies move. FSDP2 copies each gathered weight in and out of the all-gather
        buffer (also on a mesh of one, where it is the cast to the compute dtype): zero3 twice per micro-batch,
        zero2 once, DDP never; parallel.shard_frozen: false copies the adapters only. parallel.one_gpu: direct
        casts each trainable master to the compute dtype once per step: (4 + p) bytes. Its gradients' cast into
        the masters stands where FSDP2's gradient copies on a mesh of one stand, inside the fitted step efficiency
        (neither is counted here); what direct saves against FSDP2 is DIRECT_EFF (measured, calls 42-43)."""
        p = s.compute_bytes
        trainable = m.params if s.peft == "none" else m.lora_params
        if s.one_gpu_direct:  # the compiled update writes the copies as it updates (speed.optimizer_bytes)
            return 0.0 if p == 4 or s.compiled_update_runs else trainable * (4 + p)
        gathers = {"ddp": 0, "zero2": 1}.get(s.strategy, 2)
        copied = m.lora_params if s.frozen_local else m.params
        return gathers * s.grad_accum * 2 * copied * p


class DeepSpeedRules:
    """DeepSpeed ZeRO stages 0-3 (ddp, zero1, zero2, zero3), with CPU / NVMe offload."""

    name = "deepspeed"
    keeps_deepspeed_section = True
    has_one_gpu_direct = False

    def param_shards(self, s: Setting) -> int:
        return s.world if s.strategy == "zero3" else 1

    def optim_shards(self, s: Setting) -> int:
        return 1 if s.strategy == "ddp" else s.world

    def keeps_frozen_local(self, s: Setting) -> bool:
        return False  # every weight its stage partitions is partitioned

    def shard_group(self, s: Setting) -> int:
        return s.world

    def residual_bytes(self, m: ModelShape, s: Setting) -> float:
        return 0.0

    def model_states(self, m: ModelShape, s: Setting) -> dict[str, float] | None:
        """Full fine-tuning: compute-dtype parameters (whole below stage 3), and fp32 masters + moments sharded
        from stage 1, gradients from stage 2 (ZeRO, Rajbhandari et al. 2020, section 5). PEFT: None (the
        generic count, with the frozen base whole below stage 3)."""
        if s.peft != "none":
            return None
        from shardtune.plan.memory import ADAMW8BIT_BYTES

        stage = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[s.strategy]
        p, oshards = s.compute_bytes, self.optim_shards(s)
        per_optim = ADAMW8BIT_BYTES if s.optim == "adamw8bit" else 8.0
        return {
            "parameters": p * m.params / (s.world if stage == 3 else 1),
            "master_weights": 4.0 * m.params / oshards if p != 4 else 0.0,
            # compute-dtype gradients, whole below stage 2 ...
            "gradients": p * m.params if stage < 2 else p * m.params / s.world,
            "optimizer": per_optim * m.params / oshards,
            # ... and the fp32 copy of this rank's partition that the optimizer step makes
            "fp32_gradients": 4.0 * m.params / oshards if p != 4 else 0.0,
        }

    def gathered_parameters(self, m: ModelShape, s: Setting, sizes: tuple[float, float, float]) -> float:
        """Stage 3 keeps up to stage3_prefetch_bucket_size parameters gathered ahead plus the block in use;
        below it only QLoRA-style dequantised weights (none: QLoRA is FSDP2's)."""
        p = s.compute_bytes
        largest, whole, _ = sizes
        if s.strategy != "zero3":
            return float(largest * p)
        return min(whole, DS_PREFETCH_BUCKET * p + m.block_params * p) + largest * p

    def comm_buffers(self, m: ModelShape, s: Setting) -> float:
        """The reduce / all-gather buckets (reduce_bucket_size elements in the compute dtype, two in flight with
        overlap_comm); none for stage 0 or on one process (nothing to reduce: no reduce bucket is allocated)."""
        if s.strategy == "ddp" or s.world == 1:
            return 0.0
        return 2 * min(DS_REDUCE_BUCKET, m.params) * s.compute_bytes

    def gradients_before_backward(self, s: Setting) -> bool:
        """Its gradient buffers are allocated once (stage 0-1: the whole model's; stage 3: the partition's flat
        buffer), so they exist during forward too; stage 2 makes them in backward."""
        return s.strategy != "zero2"

    def efficiency(self, s: Setting) -> float:
        return DEEPSPEED_EFF[s.strategy]

    def comm_bytes(self, m: ModelShape, s: Setting, gathered: float, last_block: float) -> dict[str, float]:
        """Stages 0-1 all-reduce the gradients once a step; stage 2 reduces each micro-batch's gradients bucket by
        bucket (_zero2_reduce); stage 3 reduce-scatters them; stages 1-2 all-gather the updated parameters once a
        step; stage 3 gathers the parameters twice per micro-batch."""
        w, p = s.world, s.compute_bytes
        trainable = m.params if s.peft == "none" else m.lora_params
        out: dict[str, float] = {}
        if s.strategy in ("ddp", "zero1"):
            out["all_reduce"] = 2 * trainable * p * (w - 1) / w
        elif s.strategy == "zero2":
            out.update({kind: n * p * s.grad_accum for kind, n in _zero2_reduce(trainable, w).items() if n})
        else:
            out["reduce_scatter"] = trainable * p * (w - 1) / w * s.grad_accum
        if s.strategy in ("zero1", "zero2"):
            out["all_gather"] = trainable * p * (w - 1) / w
        if s.strategy == "zero3":
            out["all_gather"] = 2 * gathered * (w - 1) / w * s.grad_accum
        return out

    def copy_bytes(self, m: ModelShape, s: Setting) -> float:
        return 0.0  # its gathers write the parameters in place


def _zero2_reduce(elements: float, w: int) -> dict[str, float]:
    """Bus elements one micro-batch's gradient reduction moves under DeepSpeed ZeRO-2 (stage_1_and_2.py
    average_tensor): the gradients fill reduce buckets of reduce_bucket_size elements in order; a bucket that holds
    slices of several ranks' partitions is all-reduced whole (use_multi_rank_bucket_allreduce, DeepSpeed's
    default), each other bucket is reduced to the rank that owns it. Each of the w - 1 partition boundaries falls
    in one bucket, so up to (w - 1) buckets are all-reduced (all of them when one bucket holds everything). On 2
    gloo processes this is the byte count the comm counter sees (tests/dist/test_deepspeed.py): one all-reduce
    where the planner once assumed a reduce-scatter of half the bytes."""
    if w <= 1:
        return {}
    spanning = min(elements, (w - 1) * DS_REDUCE_BUCKET)
    return {"all_reduce": 2 * spanning * (w - 1) / w, "reduce": elements - spanning}


RULES: dict[str, Any] = {"fsdp2": Fsdp2Rules(), "deepspeed": DeepSpeedRules()}
