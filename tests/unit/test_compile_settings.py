"""parallel.compile_mode / parallel.compile_options: torch.compile's mode or Inductor options for each block,
checked when the config loads and passed to every block's compile."""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT

from shardtune.config import ConfigError, load_config
from shardtune.models.build import build_on_meta, load_hf_config, restore_buffers
from shardtune.parallel import prepare

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
        return prepare.uses_cudagraphs(load_config(TINY, list(overrides)).parallel)

    assert not graphs() and not graphs("parallel.compile=true")
    assert graphs("parallel.compile=true", "parallel.compile_mode=reduce-overhead")
    assert graphs("parallel.compile=true", "parallel.compile_mode=max-autotune")
    assert not graphs("parallel.compile=true", "parallel.compile_mode=max-autotune-no-cudagraphs")
    assert graphs("parallel.compile=true", "parallel.compile_options={triton.cudagraphs: true}")


def test_the_options_reach_each_blocks_compile(tmp_path):
    """Inductor's trace option writes its debug folder when a block compiles: proof the options got there; the
    compiled blocks give eager's loss."""
    opts = (f"parallel.compile_options={{trace.enabled: true, trace.debug_dir: {tmp_path}, "
            "fx_graph_cache: false}")  # a cache hit would compile nothing
    losses = []
    for overrides in ([], ["parallel.compile=true", opts]):
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
    assert list(tmp_path.rglob("output_code.py")), "Inductor wrote no trace: the options did not reach compile"
