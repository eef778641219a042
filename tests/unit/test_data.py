"""Data pipeline: tokenizer, masking, collate, JSONL errors, eval split, step sampler, shipped assets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardtune.config import DEFAULT_FIELDS
from shardtune.data import (
    Batch,
    Example,
    StepSampler,
    collate,
    eval_batches,
    eval_num_batches,
    to_device,
)
from shardtune.data.formats import RenderSpec, RowEncoder
from shardtune.data.synthetic import DEFAULT_N, DEFAULT_SEED, generate
from shardtune.errors import ShardtuneError
from shardtune.models.tokenizer import bundled_tokenizer_dir, load_tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "examples" / "data" / "tasks.jsonl"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


# ---------------------------------------------------------------- tokenizer


def test_bundled_tokenizer_special_ids_and_round_trip(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) <= 512
    for text in ["12+7=19", "rev abc=cba", "up xyz=XYZ", "héllo wörld\n\t{}", "ZZZ 0123456789"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.unk_token_id not in ids  # byte-level: everything encodes
        assert tok.decode(ids) == text
    # digits and operand letters are one token each; the task name is merged
    assert tok.convert_ids_to_tokens(tok.encode("123+45=", add_special_tokens=False)) == list("123+45=")
    assert tok.convert_ids_to_tokens(tok.encode("rev abc=", add_special_tokens=False)) == ["rev", "Ġ", "a", "b", "c",
                                                                                          "="]
    # Llama-style: bos only with add_special_tokens (the default), never eos
    assert tok.encode("cp ab=")[0] == tok.bos_token_id
    assert tok.eos_token_id not in tok.encode("cp ab=")


def test_bundled_tokenizer_loads_with_auto_tokenizer():
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(bundled_tokenizer_dir(), local_files_only=True)
    assert t.pad_token_id == 0 and t.bos_token_id == 1 and t.eos_token_id == 2
    assert bundled_tokenizer_dir().name == "tiny-tokenizer"


def test_load_tokenizer_refuses_model_dir_without_tokenizer(tmp_path):
    # Falling back to the bundled tokenizer would silently train a real model on wrong ids.
    with pytest.raises(ShardtuneError, match="has no tokenizer files"):
        load_tokenizer(str(tmp_path))
    assert len(load_tokenizer(None)) == 266  # 264 trained + chatml turn markers


def test_load_tokenizer_from_model_dir_sets_pad(tmp_path):
    t = train_tokenizer(["hello world", "12+7=19"] * 10, vocab_size=300)
    t.pad_token = None
    t.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("pad_token", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    loaded = load_tokenizer(str(tmp_path))
    assert len(loaded) == len(t) and loaded.pad_token_id == loaded.eos_token_id == 2


def test_train_tokenizer_fixed_special_ids_and_vocab_bound():
    t = train_tokenizer([f"{i}+{i}={2 * i} the quick brown fox" for i in range(200)], vocab_size=300)
    assert [t.convert_tokens_to_ids(s) for s in ("<pad>", "<s>", "</s>", "<unk>")] == [0, 1, 2, 3]
    assert 260 < len(t) <= 300
    assert t.convert_ids_to_tokens(t.encode("2024", add_special_tokens=False)) == ["2", "0", "2", "4"]




def test_collate_shapes_padding_and_masks():
    exs = [Example([1, 5, 6, 7, 2], [-100, -100, -100, 7, 2]), Example([1, 8, 2], [-100, 8, 2])]
    b = collate(exs, seq_len=8, pad_id=0)
    assert isinstance(b, Batch)
    for t in (b.input_ids, b.attention_mask, b.labels):
        assert t.shape == (2, 8) and t.dtype == torch.long
    assert b.input_ids.tolist() == [[1, 5, 6, 7, 2, 0, 0, 0], [1, 8, 2, 0, 0, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    assert b.labels.tolist() == [[-100, -100, -100, 7, 2, -100, -100, -100], [-100, 8, 2] + [-100] * 5]
    assert b.num_tokens == 8
    assert b.num_target_tokens == 4
    assert b.to("cpu").input_ids.equal(b.input_ids)


def test_a_packed_batch_moves_whole_and_pins_only_for_a_gpu(monkeypatch):
    """to_device carries every field (a packed batch's positions and document ids too); on a CPU it neither pins
    (a CPU-only torch cannot) nor copies asynchronously."""
    from shardtune.data.packing import collate_packed

    rows = [[Example([1, 5, 2], [-100, 5, 2]), Example([1, 7], [-100, 7])], [Example([1, 9, 9, 2], [-100, 9, 9, 2])]]
    b = collate_packed(rows, seq_len=6, pad_id=0)
    assert b.is_packed
    monkeypatch.setattr(Batch, "pin_memory", lambda self: pytest.fail("pinned on a CPU"))
    moved = to_device(b, torch.device("cpu"))
    for name in ("input_ids", "attention_mask", "labels", "position_ids", "document_ids"):
        assert getattr(moved, name).equal(getattr(b, name)), name
    assert moved.host_input_ids is b.input_ids  # the host's ids, for a lookup there (peft.offload_embedding)
    pinned, copies = [], []
    monkeypatch.setattr(Batch, "pin_memory", lambda self: pinned.append(self) or self)
    monkeypatch.setattr(Batch, "to", lambda self, device, non_blocking=False: copies.append((device, non_blocking))
                        or self)
    moved = to_device(b, torch.device("cuda", 0))
    assert copies == [(torch.device("cuda", 0), True)] and pinned == [b]
    assert moved.host_input_ids is b.input_ids  # the pinned copy (here the batch itself)


def test_num_target_tokens_ignores_position_zero():
    b = collate([Example([5, 6, 7], [5, 6, 7])], seq_len=4, pad_id=0)
    assert b.num_target_tokens == 2 and b.num_tokens == 3


def test_collate_fills_to_batch_size_and_rejects_overlong():
    b = collate([Example([1, 2], [-100, 2])], seq_len=4, pad_id=9, batch_size=3)
    assert b.input_ids.shape == (3, 4)
    assert b.input_ids[1:].eq(9).all() and b.attention_mask[1:].eq(0).all() and b.labels[1:].eq(-100).all()
    assert b.num_target_tokens == 1 and b.num_tokens == 2
    assert collate([], seq_len=4, pad_id=0, batch_size=2).num_target_tokens == 0
    with pytest.raises(ValueError):
        collate([Example([1] * 5, [1] * 5)], seq_len=4, pad_id=0)


def test_sampler_deterministic_and_epoch_change():
    a = StepSampler(100, 4, 2, 1, 0, seed=1)
    b = StepSampler(100, 4, 2, 1, 0, seed=1)
    assert a.global_batch_size == a.global_batch == 8 and a.steps_per_epoch == 12
    assert [a.micro_batches(s) for s in range(30)] == [b.micro_batches(s) for s in range(30)]
    assert a.micro_batches(5) == StepSampler(100, 4, 2, 1, 0, seed=1).micro_batches(5)  # no hidden state
    assert a.step_indices(0) != a.step_indices(12)  # epoch 1 reshuffles
    assert a.epoch_of(11) == 0 and a.epoch_of(12) == 1
    assert a.step_indices(0) != StepSampler(100, 4, 2, 1, 0, seed=2).step_indices(0)


@pytest.mark.parametrize(("mbs", "accum", "world"), [(2, 3, 2), (1, 1, 4), (3, 2, 1)])
def test_sampler_epoch_covered_disjointly_across_ranks(mbs, accum, world):
    n = 50
    samplers = [StepSampler(n, mbs, accum, world, r, seed=0) for r in range(world)]
    seen: list[int] = []
    for step in range(samplers[0].steps_per_epoch):
        for s in samplers:
            mb = s.micro_batches(step)
            assert len(mb) == accum and all(len(x) == mbs for x in mb)
            seen += [i for x in mb for i in x]
    g = mbs * accum * world
    assert len(seen) == len(set(seen)) == (n // g) * g  # disjoint; only the remainder is dropped


def test_sampler_same_examples_per_step_for_any_split():
    def step_set(accum: int, world: int, step: int) -> list[int]:
        return sorted(i for r in range(world) for mb in StepSampler(96, 4, accum, world, r, 5).micro_batches(step)
                      for i in mb)

    for step in (0, 3, 5, 6, 11):  # 6 steps per epoch: covers a second epoch too
        ref = step_set(4, 1, step)
        assert len(ref) == 16
        for accum, world in [(2, 2), (1, 4)]:
            assert step_set(accum, world, step) == ref
    # even the micro-batches themselves are the same chunks, just assigned to other ranks
    one = StepSampler(96, 4, 4, 1, 0, 5).micro_batches(2)
    two = [StepSampler(96, 4, 2, 2, r, 5).micro_batches(2) for r in range(2)]
    assert one == [two[0][0], two[1][0], two[0][1], two[1][1]]


def test_sampler_too_small_dataset():
    with pytest.raises(ShardtuneError, match=r"smaller than one global batch of 16.*micro_batch_size"):
        StepSampler(15, 2, 4, 2, 0, 0)


def test_sampler_state_dict_round_trip_and_position():
    a = StepSampler(100, 4, 2, 2, 1, seed=9)
    assert a.position == 0
    a.position = 7
    state = json.loads(json.dumps(a.state_dict()))
    assert state["position"] == 7 and state["epoch"] == 1 and state["global_batch_size"] == 16
    b = StepSampler(100, 2, 4, 2, 1, seed=9)  # another split of the same global batch
    b.load_state_dict(state)
    assert b.position == 7
    assert sorted(b.step_indices(7)) == sorted(a.step_indices(7))
    with pytest.raises(ValueError):
        a.position = -1


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_examples": 101}, r"had 100 examples and now has 101"),
    ({"seed": 10}, r"train\.seed was 9 and is now 10"),
    ({"grad_accum": 3}, r"global batch was 16 sequences and is now 24 .*keep the product"),
    ({"fingerprint": "other"}, r"tokenized training data changed"),
])
def test_sampler_load_state_dict_refuses_another_order(kwargs, message):
    a = StepSampler(100, 4, 2, 2, 0, seed=9, fingerprint="data-a")
    a.position = 3
    args = {"num_examples": 100, "micro_batch_size": 4, "grad_accum": 2, "world_size": 2, "rank": 0, "seed": 9,
            "fingerprint": "data-a"} | kwargs
    b = StepSampler(**args)
    with pytest.raises(ShardtuneError, match="cannot resume with the same data order: .*" + message):
        b.load_state_dict(a.state_dict())
    assert b.position == 0
    with pytest.raises(ShardtuneError, match="sampler state version"):
        b.load_state_dict({**a.state_dict(), "version": 99})


# ---------------------------------------------------------------- eval batches


@pytest.mark.parametrize(("n", "mbs", "world"), [(10, 3, 1), (10, 3, 4), (7, 2, 3), (2, 4, 4), (0, 2, 2), (16, 4, 2)])
def test_eval_batches_exactly_once_same_count(n, mbs, world):
    want = eval_num_batches(n, mbs, world)
    seen = []
    for r in range(world):
        lists = eval_batches(n, mbs, world, r)
        assert len(lists) == want and all(len(x) <= mbs for x in lists)
        assert all(i % world == r for x in lists for i in x)
        seen += [i for x in lists for i in x]
    assert sorted(seen) == list(range(n))
    assert want == max(-(-len(range(r, n, world)) // mbs) for r in range(world))


def test_eval_batches_short_rank_gets_empty_lists():
    assert eval_batches(5, 2, 4, 0) == [[0, 4]]
    assert eval_batches(5, 2, 4, 3) == [[3]]
    assert eval_batches(9, 2, 4, 3) == [[3, 7], []]


# ---------------------------------------------------------------- shipped data


def test_shipped_tasks_are_reproducible():
    rows = [json.loads(line) for line in TASKS.read_text().splitlines()]
    assert len(rows) == DEFAULT_N and rows == generate(DEFAULT_N, DEFAULT_SEED)
    assert TASKS.stat().st_size < 1_000_000


def test_generate_tasks(tok):
    rows = generate(400, 1)
    assert rows == generate(400, 1) and rows != generate(400, 2)
    assert len({r["prompt"] for r in rows}) == 400
    for r in rows:
        p, c = r["prompt"], r["completion"]
        if "+" in p:
            a, b = p[:-1].split("+")
            assert c == str(int(a) + int(b))
        else:
            op, w = p[:-1].split(" ")
            assert c == {"rev": w[::-1], "up": w.upper(), "cp": w}[op]
        ids, _ = RowEncoder(tok, RenderSpec(format="prompt_completion", columns=dict(DEFAULT_FIELDS)))(r)
        assert len(ids) <= 24
