"""model.liger: the key, its refusals before start, and the fused-loss path it selects. Liger's kernels are
Triton (CUDA only), so here the fused path runs with a plain-torch loss of the same contract
(models.liger.reference_fused_loss): the plumbing (labels shifted, -100 ignored, summed, the LM head read inside
the root forward where FSDP2 has gathered it) must give the plain path's loss and gradients."""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT, one_line_error

from shardtune.config import load_config
from shardtune.data import Batch
from shardtune.errors import ConfigError, ShardtuneError
from shardtune.models.liger import install_fused_loss, reference_fused_loss
from shardtune.models.liger_rules import (
    auto_would_take,
    check_liger,
    chunk_tokens,
    fused_loss_chunk,
    head_adapted,
    liger_installed,
    liger_kernels_wanted,
    use_liger,
)

TINY = str(ROOT / "examples" / "tiny.yaml")


@pytest.mark.parametrize("value, parsed", [("true", True), ("false", False), ("auto", "auto"), ("loss", "loss")])
def test_the_key_takes_true_false_auto_loss(value, parsed):
    assert load_config(TINY, [f"model.liger={value}"]).model.liger == parsed
    assert load_config(TINY, []).model.liger == "auto"  # where it runs: the fastest measured setting (RESULTS.md)


@pytest.mark.parametrize("tokens, vocab, hidden, rows, expected", [
    (8192, 128256, 2048, 0, (1, 256)),        # Liger's own chunk: 1B, micro-batch 4 (32 chunks a step)
    (8192, 128256, 2048, 1024, (8, 1024)),    # the default model.liger_chunk: 8 chunks
    (4096, 128256, 4096, 1024, (10, 1024)),   # 8B, micro-batch 2 (Liger's own: 128 rows)
    (8192, 128256, 2048, 100_000, (63, 8192)),  # one chunk, never more rows than tokens
    (131072, 128256, 4096, 1024, (1, 4096)),  # Liger's own chunk is already larger: kept, memory not raised
])
def test_the_chunk_follows_ligers_formula(tokens, vocab, hidden, rows, expected):
    """chunk_mem_const C gives next_pow2(ceil(tokens / ceil(vocab / (C x hidden)))) rows in Liger 0.8.5."""
    assert fused_loss_chunk(tokens, vocab, hidden, rows) == expected


def test_the_chunk_key_is_1024_tokens_for_every_method():
    from shardtune.plan.setting import setting_from_config

    assert load_config(TINY, []).model.liger_chunk == "auto"
    assert chunk_tokens("auto") == 1024 and chunk_tokens(0) == 0
    assert chunk_tokens(512) == 512
    assert setting_from_config(load_config(TINY, []), 1, 1).liger_chunk == 1024
    assert setting_from_config(load_config(TINY, ["peft.method=lora"]), 1, 1).liger_chunk == 1024
    with pytest.raises(ConfigError, match=r"model\.liger_chunk"):
        load_config(TINY, ["model.liger_chunk=-1"])


def test_the_key_refuses_other_values():
    with pytest.raises(ConfigError, match=r"model\.liger"):
        load_config(TINY, ["model.liger=fast"])


def test_the_head_gradient_is_summed_in_the_weights_dtype_unless_fp32_is_asked_for():
    # model.liger_accum -> Liger's accum_dtype: None (the weight's dtype: Liger's default and ours), or fp32
    from shardtune.models.liger import accum_dtype

    assert load_config(TINY, []).model.liger_accum == "weight"
    assert accum_dtype(load_config(TINY, []).model.liger_accum) is None
    assert accum_dtype(load_config(TINY, ["model.liger_accum=fp32"]).model.liger_accum) is torch.float32
    with pytest.raises(ConfigError, match=r"model\.liger_accum"):
        load_config(TINY, ["model.liger_accum=bf16"])


def test_auto_and_false_do_nothing_on_a_cpu():
    for setting in ("auto", False):
        check_liger(setting, "cpu", "llama")
        assert not use_liger(setting, "cpu", "llama")
    assert not use_liger("auto", "cuda", "gemma2")  # soft-capped logits: not the plain LM head the fused loss reads
    assert use_liger("auto", "cuda", "llama") == liger_installed()


@pytest.mark.parametrize("setting", [True, "loss"])
@pytest.mark.parametrize("device, model_type, words", [
    ("cpu", "llama", ["needs CUDA GPUs", "model.liger=auto"]),
    ("cuda", "gemma2", ["'gemma2'", "model.liger=false"]),
])
def test_true_and_loss_are_refused_where_they_cannot_run(setting, device, model_type, words):
    with pytest.raises(ShardtuneError) as err:
        check_liger(setting, device, model_type)
    assert all(w in str(err.value) for w in words), err.value
    assert f"model.liger: {'true' if setting is True else 'loss'}" in str(err.value)


def test_which_kernels_each_setting_swaps_in():
    """true: always; loss: never (the fused loss only); auto: not under compile, where Inductor fuses RMSNorm,
    RoPE and SwiGLU itself (measured: Liger's kernels in compiled blocks cost 15% of the speed)."""
    assert liger_kernels_wanted(True, compiled=True) and liger_kernels_wanted(True, compiled=False)
    assert not liger_kernels_wanted("loss", compiled=False) and not liger_kernels_wanted("loss", compiled=True)
    assert liger_kernels_wanted("auto", compiled=False) and not liger_kernels_wanted("auto", compiled=True)


def test_what_auto_would_take_once_installed():
    """The rule behind "pip install liger-kernel" (the run's start line and `shardtune plan`): auto takes the
    kernels without compile, the fused loss where the head has no adapter (every backend computes it); nothing on
    a CPU, on another model type, or for any other setting."""
    def takes(setting="auto", device="cuda", model="llama", compiled=True, head=False):
        return auto_would_take(setting, device, model, compiled=compiled, adapted_head=head)

    assert takes() and takes(compiled=False) and takes(compiled=False, head=True)
    assert not takes(head=True)  # LoRA on lm_head under compile: no kernels, no fused loss
    assert not takes(device="cpu") and not takes(model="gpt2")
    assert not takes(setting=True) and not takes(setting="loss") and not takes(setting=False)


def test_validate_refuses_true_on_this_cpu_in_one_line(cli):
    one_line_error(cli("validate", TINY, "model.liger=true"), "model.liger: true needs CUDA GPUs")
    one_line_error(cli("validate", TINY, "model.liger=loss"), "model.liger: loss needs CUDA GPUs")


def test_loss_is_taken_on_every_deepspeed_stage(cli):
    """DeepSpeed's stages 0-3 run the fused loss (ZeRO-3 gathers the LM head for it as an external parameter of
    the loss's module: tests/dist/test_deepspeed.py); on this CPU only the CPU's own refusal remains."""
    from shardtune.parallel import check_combination

    for strategy in ("ddp", "zero2", "zero3"):
        check_combination(load_config(TINY, ["parallel.backend=deepspeed", f"parallel.strategy={strategy}",
                                             "model.liger=loss"]))
    one_line_error(cli("validate", TINY, "parallel.backend=deepspeed", "parallel.strategy=zero3", "model.liger=loss"),
                   "model.liger: loss needs CUDA GPUs")


def test_lora_on_the_head_keeps_the_plain_loss(cli):
    """Liger's fused loss reads lm_head.weight alone: with LoRA on lm_head it would skip the adapter (zero gradient,
    an untrained head adapter exported). `loss` is refused in one line; auto / true keep the plain loss, and the
    planner prices that."""
    from shardtune.plan.setting import setting_from_config

    head = ["peft.method=lora", "peft.target_modules=[q_proj, v_proj, lm_head]"]
    cfg = load_config(TINY, head)
    assert head_adapted(cfg.peft.method, cfg.peft.target_modules)
    assert not head_adapted("none", ["lm_head"]) and not head_adapted("lora", "all-linear")  # all-linear skips it
    assert not head_adapted("lora", ["q_proj", "v_proj"])
    with pytest.raises(ShardtuneError, match=r"remove lm_head from peft\.target_modules"):
        check_liger("loss", "cuda", "llama", adapted_head=True)
    if liger_installed():  # true: the kernels go in, the loss stays plain
        check_liger(True, "cuda", "llama", adapted_head=True)
    one_line_error(cli("validate", TINY, "model.liger=loss", *head), "puts a LoRA adapter on lm_head")
    assert not setting_from_config(cfg, 1, 1, liger=True).fused_loss
    assert setting_from_config(load_config(TINY, ["peft.method=lora"]), 1, 1, liger=True).fused_loss


def _batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    labels[1, 9:] = -100  # padding
    return Batch(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)


FUSED_CALLS = []
NORM_IN_BACKWARD = []  # the final norm's weight type when the gradient reaches it (DTensor: resharded, freed)
FUSED_MODEL = []


def _counted(weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """reference_fused_loss, counting its calls: the fused backend really took the fused path."""
    FUSED_CALLS.append(type(weight).__name__)  # a plain tensor under FSDP2: the root forward gathered it
    if hidden.requires_grad:
        hidden.register_hook(lambda g: NORM_IN_BACKWARD.append(type(FUSED_MODEL[0].model.norm.weight).__name__))
    return reference_fused_loss(weight, hidden, targets)


def _tiny_backends(strategy: str, *overrides: str):
    """Two FSDP2 backends (a gloo group of 1) over the same tiny-llama weights: the plain loss, the fused one."""
    from shardtune.assemble import assemble
    from shardtune.dist import init_distributed
    from shardtune.models.build import load_hf_config
    from shardtune.parallel import make_backend
    from shardtune.train.loss import token_loss_sum
    from shardtune.train.optim import OptimizerFactory

    cfg = load_config(TINY, [f"parallel.strategy={strategy}", "parallel.nproc=1", *overrides])
    ctx = init_distributed()
    hf_config = load_hf_config(cfg.model)
    out = []
    for fused in (False, True):
        built = assemble(cfg.model, cfg.peft, "fp32", hf_config, ctx.device, 1)
        backend = make_backend(cfg, ctx, token_loss_sum)
        if fused:
            install_fused_loss(built.base, _counted)
            backend.fused_loss = True
            FUSED_MODEL[:] = [built.base]
        backend.setup(built.model, built.blocks, built.source, OptimizerFactory(cfg.optim, cfg.train.lr))
        out.append(backend)
    return out


@pytest.mark.parametrize("strategy, peft", [("zero2", "none"), ("zero3", "none"), ("ddp", "none"),
                                            ("zero3", "lora"), ("zero2", "lora")])
def test_the_fused_loss_path_gives_the_plain_loss_and_gradients(strategy, peft):
    """Also with LoRA under zero3, where every root parameter (embedding, final norm, LM head) is frozen and
    resharded after forward: only FSDP2's pre-backward hook on the model's output gathers them again for the
    final norm's backward, so the fused path's output must be one FSDP2 sees into (on the GPU it read freed
    memory: an illegal memory access in Liger's RMSNorm backward, bench/RESULTS.md 2026-12-02)."""
    try:
        plain, fused = _tiny_backends(strategy, f"peft.method={peft}")
        FUSED_CALLS.clear()
        NORM_IN_BACKWARD.clear()
        batch = _batch()
        normalizer = torch.tensor(float((batch.labels[:, 1:] != -100).sum()))
        losses = [b.forward_backward(batch, normalizer) for b in (plain, fused)]
        assert float(losses[0]) == pytest.approx(float(losses[1]), abs=1e-6)
        assert FUSED_CALLS in (["Parameter"], ["Tensor"]), FUSED_CALLS  # once, on the gathered LM head
        # The final norm's backward runs on gathered weights (CPU reads freed memory without complaint).
        assert NORM_IN_BACKWARD in (["Parameter"], ["Tensor"]), NORM_IN_BACKWARD
        grads = [{n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                  for n, p in b.module.named_parameters()} for b in (plain, fused)]
        assert grads[0].keys() == grads[1].keys() and any("lm_head" in n or "embed" in n for n in grads[0])
        for name in grads[0]:
            torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)
        # Evaluation (no labels) still gets logits from the same module.
        assert fused.forward(batch).shape == (2, 12, fused.module.config.vocab_size)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_fsdp2_sees_the_loss_in_the_fused_output():
    """FSDP2 (torch 2.11) finds the tensors of a module's output with pytree and hooks the root's pre-backward
    (which gathers the root's resharded parameters for backward) on them: the loss must be one of the leaves."""
    from torch.utils._pytree import tree_flatten

    from shardtune.models.liger import FusedLossOutput

    loss = torch.ones((), requires_grad=True)
    leaves, _ = tree_flatten(FusedLossOutput(loss=loss))
    assert len(leaves) == 1 and leaves[0] is loss


def test_the_fused_forward_shifts_labels_and_ignores_the_masked_ones():
    from shardtune.models.build import build_on_meta, load_hf_config, restore_buffers
    from shardtune.train.loss import token_loss_sum

    cfg = load_config(TINY, [])
    model = build_on_meta(load_hf_config(cfg.model), "sdpa").to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    restore_buffers(model, torch.device("cpu"))  # RoPE's inv_freq: `to_empty` leaves it uninitialised (CI got NaN)
    batch = _batch(1)
    want = token_loss_sum(model(input_ids=batch.input_ids).logits, batch.labels)
    install_fused_loss(model, reference_fused_loss)
    got = model(input_ids=batch.input_ids, labels=batch.labels).loss
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-6)


# liger_kernel/ops/fused_linear_cross_entropy.py of liger-kernel 0.8.5 (BSD-2-Clause), its backward helper verbatim,
# in a stand-in module whose Triton kernel records its launches (Triton does not run on a CPU).
LIGER_085_MODULE = """import torch


class _Kernel:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


element_mul_kernel = _Kernel()
MAX_FUSED_SIZE = 65536 // 2


class triton:
    @staticmethod
    def next_power_of_2(n):
        return 1 << (n - 1).bit_length()


def is_hip():
    return torch.version.hip is not None


def fused_linear_cross_entropy_backward(grad_output, grad_input, grad_weight, grad_bias):
    # If cross entropy is the last layer, grad_output is 1.0. Skip the mul to save time
    if not torch.equal(grad_output, torch.tensor(1.0, device=grad_output.device)):
        # We use a Triton kernel instead of a PyTorch operation because modifying inputs in-place
        # for gradient storage and backward multiple times causes anomalies with PyTorch but not with Triton.
        BT, H = grad_input.shape
        n_rows = BT
        BLOCK_SIZE = min(MAX_FUSED_SIZE, triton.next_power_of_2(H))

        element_mul_kernel[(n_rows,)](
            grad_input,
            grad_input.stride(-2),
            grad_output,
            H,
            BLOCK_SIZE=BLOCK_SIZE,
            X_col_stride=grad_input.stride(-1),
            num_warps=32 if not is_hip() else 16,
        )

        # handle grad_weight
        if grad_weight is not None:
            V, H = grad_weight.shape
            n_rows = V

            element_mul_kernel[(n_rows,)](
                grad_weight,
                grad_weight.stride(-2),
                grad_output,
                H,
                BLOCK_SIZE=BLOCK_SIZE,
                X_col_stride=grad_weight.stride(-1),
                num_warps=32 if not is_hip() else 16,
            )

        if grad_bias is not None:
            V = grad_bias.shape[0]
            n_rows = V

            element_mul_kernel[(n_rows,)](
                grad_bias,
                grad_bias.stride(-1),
                grad_output,
                1,
                BLOCK_SIZE=BLOCK_SIZE,
                num_warps=32 if not is_hip() else 16,
            )
    return grad_input, grad_weight, grad_bias
"""


@pytest.fixture
def stand_in_liger(tmp_path, monkeypatch):
    """A liger_kernel package on sys.path whose ops.fused_linear_cross_entropy is LIGER_085_MODULE (or the text the
    test writes); a real Liger (GPU machine) comes back after the test."""
    import sys

    def ligers() -> list[str]:
        return [m for m in sys.modules if m == "liger_kernel" or m.startswith("liger_kernel.")]

    def install(text: str = LIGER_085_MODULE):
        ops = tmp_path / "liger_kernel" / "ops"
        ops.mkdir(parents=True, exist_ok=True)
        (tmp_path / "liger_kernel" / "__init__.py").write_text("")
        (ops / "__init__.py").write_text("")
        (ops / "fused_linear_cross_entropy.py").write_text(text)
        from liger_kernel.ops import fused_linear_cross_entropy as flce

        return flce

    for name in ligers():
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield install
    for name in ligers():  # the stand-in must not look installed to later tests
        del sys.modules[name]


def _grads():
    return torch.randn(6, 3000), torch.randn(40, 3000), torch.randn(40)  # hidden 3000: BLOCK_SIZE 4096


def _same_launches(a: list, b: list) -> bool:
    def key(launch):
        grid, args, kwargs = launch
        return grid, [id(x) if isinstance(x, torch.Tensor) else x for x in args], kwargs
    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("with_weight", [True, False])
def test_the_backward_without_the_sync_launches_what_liger_launches(stand_in_liger, with_weight):
    """shardtune's loss is divided by the token count, so Liger's helper always multiplies: the helper swapped in
    launches Liger's own kernel exactly as Liger 0.8.5 does then (grid, arguments, settings), without the test."""
    from shardtune.models.liger import REPLACED, backward_without_sync, skip_backward_sync

    flce = stand_in_liger()
    original = flce.fused_linear_cross_entropy_backward
    g_in, g_w, g_b = _grads()
    if not with_weight:
        g_w = g_b = None
    scale = torch.tensor(0.25)
    assert original(scale, g_in, g_w, g_b) == (g_in, g_w, g_b)
    want, flce.element_mul_kernel.launches = flce.element_mul_kernel.launches, []
    assert len(want) == (3 if with_weight else 1) and want[0][2]["BLOCK_SIZE"] == 4096
    assert skip_backward_sync() and flce.fused_linear_cross_entropy_backward is backward_without_sync
    assert len(REPLACED) == 1 and REPLACED[0] is original
    assert backward_without_sync(scale, g_in, g_w, g_b) == (g_in, g_w, g_b)
    assert _same_launches(flce.element_mul_kernel.launches, want)
    assert skip_backward_sync()  # already in place: stays


@pytest.mark.parametrize("change", ["an extra argument", "no test", "another kernel count"])
def test_a_liger_whose_helper_changed_keeps_its_own(stand_in_liger, change):
    from shardtune.models.liger import skip_backward_sync

    text = {"an extra argument": LIGER_085_MODULE.replace("grad_weight, grad_bias):", "grad_weight, grad_bias, x=0):"),
            "no test": LIGER_085_MODULE.replace("if not torch.equal(", "if not torch.allclose("),
            "another kernel count": LIGER_085_MODULE.replace("    return grad_input, grad_weight, grad_bias",
                                                             "    element_mul_kernel[(1,)](grad_input)\n"
                                                             "    return grad_input, grad_weight, grad_bias")}[change]
    assert text != LIGER_085_MODULE
    flce = stand_in_liger(text)
    original = flce.fused_linear_cross_entropy_backward
    assert not skip_backward_sync()
    assert flce.fused_linear_cross_entropy_backward is original
