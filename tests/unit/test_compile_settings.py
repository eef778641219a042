"""parallel.compile_mode / parallel.compile_options: torch.compile's mode or Inductor options for each block,
checked when the config loads and passed to every block's compile."""

from __future__ import annotations

import pytest
import torch
from conftest import MICRO, ROOT

from shardtune.config import ConfigError, load_config
from shardtune.models.build import build_on_meta, load_hf_config, restore_buffers
from shardtune.parallel import prepare, uses_cudagraphs

TINY = str(ROOT / "examples" / "tiny.yaml")


@pytest.mark.parametrize("overrides, fragment", [
    (["parallel.compile_mode=max-autotune"], "need parallel.compile=true"),
    (["parallel.compile=true", "parallel.compile_mode=reduce-overhead", "parallel.compile_options={cpp_wrapper: true}"],
     "not both"),
    (["parallel.compile=true", "parallel.compile_options={cpp_wraper: true}"],
     "'cpp_wraper' is not an Inductor option (did you mean 'cpp_wrapper'?)"),
    (["parallel.compile=true", "parallel.compile_options={cpp_wrapper: 1}"], "cpp_wrapper takes a bool"),
    (["parallel.compile=true", "parallel.compile_mode=fast"], "parallel.compile_mode"),
])
def test_bad_compile_settings_are_refused_in_one_line(overrides, fragment):
    with pytest.raises(ConfigError, match="parallel") as err:
        load_config(TINY, overrides)
    assert fragment in str(err.value) and "\n" not in str(err.value).strip()


def test_the_settings_become_torch_compile_arguments():
    def kwargs(*overrides):
        return prepare.compile_kwargs(load_config(TINY, ["parallel.compile=true", *overrides]).parallel)

    assert kwargs() == {}
    assert kwargs("parallel.compile_mode=max-autotune-no-cudagraphs") == {"mode": "max-autotune-no-cudagraphs"}
    assert kwargs("parallel.compile_options={cpp_wrapper: true}") == {"options": {"cpp_wrapper": True}}


def test_cuda_graph_settings_are_recognised():
    def graphs(*overrides):
        return uses_cudagraphs(load_config(TINY, list(overrides)).parallel)

    assert not graphs() and not graphs("parallel.compile=true")
    assert graphs("parallel.compile=true", "parallel.compile_mode=reduce-overhead")
    assert graphs("parallel.compile=true", "parallel.compile_mode=max-autotune")
    assert not graphs("parallel.compile=true", "parallel.compile_mode=max-autotune-no-cudagraphs")
    assert graphs("parallel.compile=true", "parallel.compile_options={triton.cudagraphs: true}")


def test_the_options_reach_each_blocks_compile(tmp_path):
    """Inductor's trace option writes its debug folder when a block compiles: proof the options got there, for
    every block; the compiled blocks give eager's loss. (micro-llama: two blocks, half tiny-llama's compiles.)"""
    opts = (f"parallel.compile_options={{trace.enabled: true, trace.debug_dir: {tmp_path}, "
            "fx_graph_cache: false}")  # a cache hit would compile nothing
    losses = []
    for overrides in ([MICRO], [MICRO, "parallel.compile=true", opts]):
        cfg = load_config(TINY, overrides)
        model = build_on_meta(load_hf_config(cfg.model), "sdpa").to_empty(device="cpu")
        torch.manual_seed(0)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.05)
        restore_buffers(model, torch.device("cpu"))
        prepare.checkpoint_and_compile(model, list(model.model.layers), cfg.parallel)
        ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(1))
        losses.append(float(model(input_ids=ids, labels=ids).loss))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    forwards = [p for p in tmp_path.rglob("output_code.py") if "_forward_" in p.parent.name]  # (a backward compiles
    # now or at its first use, by what earlier tests in the process left set)
    assert len(forwards) == len(model.model.layers) == 2, f"{len(forwards)} forward traces: a block's compile missed"


def test_cuda_graphs_under_checkpointing_around_the_blocks_are_refused_before_launch(cli):
    # torch's CUDA graph trees stop the first backward under a recompute run from Python (pytorch/pytorch#154306;
    # 8B LoRA on an H100): the checkpoint around the compiled blocks is refused by validate in one line, with the
    # fix; inside them (checkpoint_in_compile auto, and selective always) there is no such recompute (8B QLoRA
    # with reduce-overhead ran on an H100, call 83)
    proc = cli("validate", TINY, "parallel.compile=true", "parallel.compile_mode=reduce-overhead",
               "parallel.activation_checkpointing=full", "parallel.checkpoint_in_compile=false")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "parallel.compile_mode=reduce-overhead" in lines[0] and "pytorch/pytorch#154306" in lines[0]
    assert "max-autotune-no-cudagraphs" in lines[0] and "activation_checkpointing=none" in lines[0]
    for ac in ("none", "full", "selective"):
        ok = cli("validate", TINY, "parallel.compile=true", "parallel.compile_mode=reduce-overhead",
                 f"parallel.activation_checkpointing={ac}")
        assert ok.returncode == 0, (ac, ok.stderr)


def test_the_planner_prices_checkpointing_with_cuda_graphs_only_inside_the_blocks():
    from shardtune.models.presets import preset_config
    from shardtune.plan import make_plan
    from shardtune.plan.hardware import lookup

    cfg = load_config("bench/bench.yaml", ["data.train_file=examples/data/tasks.jsonl", "model.preset=llama-3.2-1b",
                                           "parallel.strategy=auto", "parallel.compile=true",
                                           "parallel.compile_mode=reduce-overhead",
                                           "parallel.checkpoint_in_compile=false"])
    plan = make_plan(cfg, preset_config("llama-3.2-1b"), lookup("h200"), world=1, per_node=1)
    assert plan.pick is not None and plan.pick.setting.activation_checkpointing == "none"
    # full checkpointing would be around the blocks: not priced; selective is traced inside them whatever the flag
    assert {c.setting.activation_checkpointing for c in plan.result.candidates} == {"none", "selective"}
    # with the checkpoint inside the compiled blocks (auto), full is priced too, but not with activation offload
    cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"checkpoint_in_compile": "auto"})})
    plan = make_plan(cfg, preset_config("llama-3.2-1b"), lookup("h200"), world=1, per_node=1)
    full = [c.setting for c in plan.result.candidates if c.setting.activation_checkpointing == "full"]
    assert full and all(s.checkpoint_traced and not s.activation_offload for s in full)


def test_auto_with_cuda_graphs_and_checkpointing_set_says_why(cli):
    # strategy auto with checkpointing around the blocks fixed by the config: every candidate is refused for the CUDA
    # graphs, and the
    # error says so (not "nothing fits" with fixes that do not apply)
    proc = cli("validate", TINY, "parallel.strategy=auto", "parallel.compile=true",
               "parallel.compile_mode=reduce-overhead", "parallel.activation_checkpointing=full",
               "parallel.checkpoint_in_compile=false")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "pytorch/pytorch#154306" in lines[0] and "fits" not in lines[0], lines[0]
