"""Tests of the benchmark summary and the long-text generator (pure Python; `pytest bench/`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_long_text
import summarize


def _metrics(path: Path, tps_by_step: dict[int, float], seq: int = 2048, mbs: int = 4, every: int = 5,
             precision: str = "bf16") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for step, tps in tps_by_step.items():
            f.write(json.dumps({"step": step, "loss": 2.0, "lr": 1e-5, "grad_norm": 1.0, "tokens_per_sec": 2 * tps,
                                "tokens_per_sec_per_device": tps, "mfu": tps * 7.7e9 / 989e12,
                                "peak_mem_gib": 30.0 + step / 100, "peak_reserved_gib": 33.0,
                                "step_time_s": mbs * seq / tps}) + "\n")
        f.write(json.dumps({"eval": True, "step": 40, "eval_loss": 1.0, "eval_accuracy": 0.0}) + "\n")
    (path.parent / "config.yaml").write_text(f"train:\n  micro_batch_size: {mbs}\n  seq_len: {seq}\n"
                                             f"  precision: {precision}\nparallel:\n  strategy: zero2\n"
                                             f"  compile: false\nlog:\n  every: {every}\n")
    return path


def _result_log(path: Path, mode: str, tps: int, **shape: object) -> Path:
    res = {"mode": mode, "size": "1b", "world": 2, "seq": 2048, "mbs": 4, "precision": "bf16", **shape,
           "step_s_median": 8192 / tps,
           "tokens_per_s_per_gpu": tps, "mfu_989": 0.336, "peak_alloc_gib": 34.4, "peak_reserved_gib": 36.0}
    path.write_text("[rank0]: some noise\nRESULT " + json.dumps(res) + "\n")
    return path


def test_steady_state_median_skips_warmup_and_eval(tmp_path: Path) -> None:
    m = _metrics(tmp_path / "zero2" / "metrics.jsonl", {5: 1000.0, 10: 2000.0, 15: 40000.0, 20: 42000.0, 25: 41000.0})
    r = summarize.summarize_shardtune("zero2", m, warmup=10)
    assert r["status"] == "ok"
    assert r["steady_steps"] == [15, 20, 25]
    assert r["tokens_per_s_per_gpu"] == 41000.0
    assert r["peak_alloc_gib"] == 30.25  # max over all records
    assert abs(r["fill"] - 1.0) < 1e-9


def test_records_that_include_a_checkpoint_save_are_left_out(tmp_path: Path) -> None:
    m = _metrics(tmp_path / "z" / "metrics.jsonl", {5: 1000.0, 10: 2000.0, 15: 40000.0, 20: 38000.0, 25: 900.0})
    rows = [json.loads(line) for line in m.read_text().splitlines()]
    rows[4]["checkpoint_s"] = 40.0  # the last interval wrote the end-of-run checkpoint
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = summarize.summarize_shardtune("z", m, warmup=10)
    assert r["steady_steps"] == [15, 20] and r["skipped_checkpoint_steps"] == [25]
    assert r["tokens_per_s_per_gpu"] == 39000.0  # not 38000, the median with the save's interval in


def test_short_run_falls_back_to_last_record(tmp_path: Path) -> None:
    m = _metrics(tmp_path / "a" / "metrics.jsonl", {5: 1000.0, 10: 2000.0})
    r = summarize.summarize_shardtune("a", m, warmup=10)
    assert r["warmup_fallback"] and r["tokens_per_s_per_gpu"] == 2000.0


def test_manifest_ratios_failures_and_table(tmp_path: Path) -> None:
    ok = _metrics(tmp_path / "zero2" / "metrics.jsonl", {15: 44000.0, 20: 44000.0})
    ref = _result_log(tmp_path / "hf_ds2.log", "hf_ds2", 40000)
    bad_log = tmp_path / "zero3c.log"
    bad_log.write_text("Traceback\n[rank0]: RuntimeError: CUDA out of memory\n"
                       "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    man = tmp_path / "runs.tsv"
    man.write_text(f"hf_ds2\tbaseline\t0\t50\t{ref}\t\n"
                   f"zero2\tshardtune\t0\t30\t{tmp_path / 'zero2.log'}\t{ok}\n"
                   f"zero3c\tshardtune\t1\t20\t{bad_log}\t{tmp_path / 'zero3c' / 'metrics.jsonl'}\n"
                   "fsdp2c\tskipped\t\t\t\t\n")
    out = tmp_path / "results.jsonl"
    assert summarize.main(["--manifest", str(man), "--results", str(out), "--table", str(tmp_path / "t.md")]) == 0
    rows = {r["name"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["zero2"]["ratio_vs_hf_ds2"] == 1.1
    assert rows["hf_ds2"]["ratio_vs_hf_ds2"] == 1.0
    assert rows["zero3c"]["status"] == "failed" and "CUDA out of memory" in rows["zero3c"]["error"]
    assert rows["fsdp2c"]["status"] == "skipped"
    table = (tmp_path / "t.md").read_text().strip().splitlines()
    assert table[-4].startswith("| hf_ds2 | 40,000 | 1.00 |")
    assert table[-3].startswith("| zero2 | 44,000 | 1.10 |")
    assert table[-2].startswith("| zero3c (rc=1) |")


def test_timeout_keeps_logged_numbers(tmp_path: Path) -> None:
    m = _metrics(tmp_path / "z" / "metrics.jsonl", {15: 40000.0})
    r = summarize.summarize_entry({"name": "z", "kind": "shardtune", "rc": 124, "metrics": str(m), "log": None}, 10)
    assert r["status"] == "timeout" and r["has_data"] and r["tokens_per_s_per_gpu"] == 40000.0


def test_long_text_fills_sequences() -> None:
    from shardtune.models.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    lines = make_long_text.make_lines(4, 100, seed=1, min_tokens=300)  # short chars: the check must extend
    assert all(len(tok.encode(t, add_special_tokens=False)) >= 300 for t in lines)
    assert lines == make_long_text.make_lines(4, 100, seed=1, min_tokens=300)  # deterministic


def test_nonzero_exit_after_finishing_keeps_status_ok(tmp_path: Path) -> None:
    log = _result_log(tmp_path / "fsdp2.log", "fsdp2", 30000)
    r = summarize.summarize_entry({"name": "fsdp2", "kind": "baseline", "rc": 1, "log": str(log)}, 10)
    assert r["status"] == "ok" and r["exit_note"] == "rc=1 after finishing"
    m = _metrics(tmp_path / "z" / "metrics.jsonl", {15: 40000.0})
    r = summarize.summarize_entry({"name": "z", "kind": "shardtune", "rc": 1, "metrics": str(m), "log": None}, 10)
    assert r["status"] == "failed"  # no summary.json: it did not finish
    (m.parent / "summary.json").write_text("{}")
    r = summarize.summarize_entry({"name": "z", "kind": "shardtune", "rc": 1, "metrics": str(m), "log": None}, 10)
    assert r["status"] == "ok"


def test_checkpoint_bench_sums_the_excess_during_a_save_and_over_as_many_steps_before_it():
    import checkpoint

    times = {3: 1.0, 4: 1.2, 5: 0.9, 6: 1.0, 7: 2.9, 8: 1.5, 9: 1.0, 10: 1.0}
    recs = [{"step": s, "step_time_s": t} for s, t in times.items()]
    # step 7 saved (3.0 s in all: step_time_s leaves the 0.1 s it blocked out); its write ended in step 8's record
    recs[4]["checkpoint_s"] = 0.1
    recs[5]["checkpoint_write_s"] = 4.0
    assert checkpoint._extra_during_saves(recs, 1.0) == pytest.approx([2.0 + 0.5])
    assert checkpoint._extra_before_saves(recs, 1.0) == pytest.approx([-0.1 + 0.0])  # steps 5 and 6
    assert checkpoint._extra_before_saves(recs[3:], 1.0) == []  # too few steps before the save


def test_warmup_is_excluded_by_where_each_interval_starts(tmp_path: Path) -> None:
    # log.every 5, warm-up 12: the record at step 15 times steps 11-15, two of them warm-up; the median must
    # start at the record whose interval starts after step 12 (step 20 covers 16-20).
    m = _metrics(tmp_path / "z" / "metrics.jsonl", {5: 100.0, 10: 200.0, 15: 300.0, 20: 40000.0, 25: 42000.0})
    r = summarize.summarize_shardtune("z", m, warmup=12)
    assert r["steady_steps"] == [20, 25] and r["tokens_per_s_per_gpu"] == 41000.0
    # the last record may cover fewer steps (the run's end): it starts where the previous one ended
    m = _metrics(tmp_path / "y" / "metrics.jsonl", {5: 100.0, 10: 200.0, 12: 300.0, 15: 40000.0})
    assert summarize.summarize_shardtune("y", m, warmup=12)["steady_steps"] == [15]


@pytest.mark.parametrize(("field", "row", "why"), [
    ("mbs", {"mbs": 8}, "micro-batch 8 vs 4"), ("seq", {"seq": 4096}, "seq_len 4096 vs 2048"),
    ("world", {"world": 1}, "world size 1 vs 2"), ("precision", {"precision": "fp32"}, "precision fp32 vs bf16")])
def test_a_row_of_another_shape_than_its_baseline_gets_no_ratio(tmp_path: Path, field, row, why) -> None:
    shape = {"mbs": 4, "seq": 2048, "precision": "bf16", **{k: v for k, v in row.items() if k != "world"}}
    ok = _metrics(tmp_path / "zero2" / "metrics.jsonl", {15: 44000.0, 20: 44000.0}, **shape)
    if field == "world":  # tokens_per_sec = 2 x per device in _metrics: move the baseline instead
        ref = _result_log(tmp_path / "hf_ds2.log", "hf_ds2", 40000, world=4)
        why = "world size 2 vs 4"
    else:
        ref = _result_log(tmp_path / "hf_ds2.log", "hf_ds2", 40000)
    same = _metrics(tmp_path / "zero3" / "metrics.jsonl", {15: 42000.0, 20: 42000.0})
    out = tmp_path / "results.jsonl"
    assert summarize.main([f"zero2={ok}", f"zero3={same}", f"hf_ds2={ref}", "--results", str(out)]) == 0
    rows = {r["name"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["zero2"]["ratio_vs_hf_ds2"] is None and rows["zero2"]["ratio_refused"] == {"hf_ds2": why}
    if field != "world":
        assert rows["zero3"]["ratio_vs_hf_ds2"] == 1.05  # the same shape keeps its ratio


def test_pairs_from_different_calls_are_refused_unless_marked(tmp_path: Path, capsys) -> None:
    a = _metrics(tmp_path / "call1" / "zero2" / "metrics.jsonl", {15: 44000.0, 20: 44000.0})
    ref = _result_log(tmp_path / "call2.log", "hf_ds2", 40000)
    with pytest.raises(SystemExit) as err:
        summarize.main([f"zero2={a}", f"hf_ds2={ref}"])
    assert err.value.code == 2
    msg = capsys.readouterr().err.strip()
    assert "different calls" in msg and "--cross-call" in msg and "\n" not in msg
    assert summarize.main([f"zero2={a}", f"hf_ds2={ref}", "--cross-call"]) == 0
    assert "runs from different calls (--cross-call)" in capsys.readouterr().out


def test_table_shows_the_spread_and_a_second_reference(tmp_path: Path) -> None:
    """Table 1 of issue 17: the shardtune row's min-max over its steady records, the baseline's from its RESULT
    (hf_trainer_baseline.py), and a ratio column against HF + Liger (--second-ref)."""
    st = _metrics(tmp_path / "zero2c_lg" / "metrics.jsonl", {5: 1000.0, 15: 52000.0, 20: 53000.0, 25: 50000.0})
    ref = _result_log(tmp_path / "hft_ds2.log", "hf_trainer_ds", 40000, tokens_per_s_per_gpu_min=39000,
                      tokens_per_s_per_gpu_max=41000, steps_timed=35)
    lg = _result_log(tmp_path / "hft_ds2_liger.log", "hf_trainer_ds_liger", 46000)
    table = tmp_path / "t.md"
    assert summarize.main([f"hft_ds2={ref}", f"hft_ds2_liger={lg}", f"zero2c_lg={st}", "--ref", "hft_ds2",
                           "--second-ref", "hft_ds2_liger", "--spread", "--table", str(table)]) == 0
    rows = {line.split(" | ")[0].strip("| "): line for line in table.read_text().splitlines() if line.startswith("|")}
    assert rows["variant"].startswith("| variant | tokens/s/GPU | min-max | ratio vs hft_ds2 | vs hft_ds2_liger |")
    assert rows["zero2c_lg"].startswith("| zero2c_lg | 52,000 | 50,000-53,000 (n=3) | 1.30 | 1.13 |")
    assert rows["hft_ds2"].startswith("| hft_ds2 | 40,000 | 39,000-41,000 (n=35) | 1.00 |")
    assert rows["hft_ds2_liger"].startswith("| hft_ds2_liger | 46,000 | – | 1.15 | 1.00 |")


def test_combine_divides_every_tagged_run_by_the_calls_baselines(tmp_path: Path) -> None:
    """ab_1b.sh / liger_chunk.sh: one core.sh run per tree or chunk size, the baselines in their own; the combined
    table names each shardtune run by its tag and divides it by the baselines (which each run's own table could
    not: call 49-51's tables printed '–')."""
    import combine

    def results(tag: str, *rows: dict) -> None:
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    shape = {"seq": 2048, "mbs": 4, "precision": "bf16", "status": "ok"}
    results("baselines", {"name": "hft_ds2", "kind": "baseline", "tokens_per_s_per_gpu": 40000, **shape},
            {"name": "hft_ds2_liger", "kind": "baseline", "tokens_per_s_per_gpu": 50000, **shape})
    results("old_e1", {"name": "zero2c_lgl_dir", "kind": "shardtune", "tokens_per_s_per_gpu": 60000, **shape})
    results("new_e1", {"name": "zero2c_lgl_dir", "kind": "shardtune", "tokens_per_s_per_gpu": 61000, **shape})
    rows = {r["name"]: r for r in combine.combine(tmp_path, ["baselines", "old_e1", "new_e1", "missing"],
                                                  "hft_ds2", "hft_ds2_liger")}
    assert sorted(rows) == ["hft_ds2", "hft_ds2_liger", "new_e1: zero2c_lgl_dir", "old_e1: zero2c_lgl_dir"]
    assert rows["old_e1: zero2c_lgl_dir"]["ratio_vs_hft_ds2"] == 1.5
    assert rows["new_e1: zero2c_lgl_dir"]["ratio_vs_hft_ds2_liger"] == 1.22
    table = summarize.render_table(list(rows.values()), "hft_ds2", "hft_ds2_liger", spread=True)
    header, _, *lines = table.splitlines()
    assert all(line.count("|") == header.count("|") for line in lines)  # every row fills every column
    assert "| new_e1: zero2c_lgl_dir | 61,000 | – | 1.52 | 1.22 |" in table
