"""`shardtune report` and the report `train` writes at the end, from real runs: the session's 2-process FSDP2
launch (tests/conftest.py `fsdp2_runs`), whose plain zero2 / zero3 variants keep log.report on
(ddp's run is overlaid by `shardtune report`)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ["loss.png", "throughput.png", "memory.png", "comm.png"]  # checkpoints.png: only runs that saved one


def _images(page: Path) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', page.read_text())


def _valid_png(path: Path) -> tuple[int, int]:
    from PIL import Image  # matplotlib's own dependency

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        return im.size


@pytest.fixture(scope="module")
def runs(fsdp2_runs) -> dict[str, Path]:
    two = fsdp2_runs[1]
    return {v: Path(two[v]["output_dir"]) for v in ("ddp", "zero2", "zero3")}


def test_train_writes_the_report_into_the_output_dir(runs):
    page = runs["zero3"] / "report" / "report.html"
    assert page.is_file()
    images = _images(page)
    assert set(PLOTS) <= set(images)
    for name in images:
        width, height = _valid_png(page.parent / name)
        assert width >= 600 and height >= 250
    text = page.read_text()
    assert "strategy: zero3" in text  # the resolved config, from config.yaml
    assert "tokens_per_sec_per_gpu" in text  # the planner's prediction against the run (summary.json's plan)


def test_report_command_overlays_several_runs(runs, tmp_path, cli):
    out = tmp_path / "cmp"
    result = cli("report", str(runs["ddp"]), str(runs["zero2"]), str(runs["zero3"]), "--out", str(out))
    assert result.returncode == 0, result.stderr
    page = out / "report.html"
    assert f"wrote {page}" in result.stdout
    text = page.read_text()
    for name in ("ddp", "zero2", "zero3"):
        assert f"<h2>{name}</h2>" in text  # one section per run
    assert "strategy: ddp" in text and "strategy: zero2" in text
    for name in _images(page):
        _valid_png(out / name)
    # One image per plot with every run drawn on it, not one per run.
    images = _images(page)
    assert set(PLOTS) <= set(images) and len(images) == len(set(images)) <= len(PLOTS) + 1


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (apt-get install chromium)")
def test_report_renders_in_headless_chromium(runs, tmp_path):
    """The page as a browser shows it: every image loads, nothing is logged to the console, a screenshot is
    taken. A copy of the page gets a script that puts the image check into the title, which --dump-dom prints."""
    src = runs["zero2"] / "report"
    page = tmp_path / "report"
    shutil.copytree(src, page)
    probe = ("<script>addEventListener('load',()=>{const bad=[...document.images].filter(i=>!i.complete||"
             "!i.naturalWidth).map(i=>i.src);document.title=bad.length?'BROKEN '+bad.join(' '):"
             "'IMAGES-OK '+document.images.length;});</script>")
    html = (page / "report.html").read_text().replace("</body>", probe + "</body>")
    (page / "checked.html").write_text(html)
    base = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
            "--enable-logging=stderr", "--v=0"]
    url = (page / "checked.html").as_uri()
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr
    assert f"<title>IMAGES-OK {len(_images(page / 'report.html'))}</title>" in dom.stdout, dom.stdout[:500]
    assert "CONSOLE" not in dom.stderr, dom.stderr  # console messages (errors included) are logged as CONSOLE(...)
    shot = tmp_path / "shot.png"
    done = subprocess.run([*base, f"--screenshot={shot}", "--window-size=1200,2000", (page / "report.html").as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and _valid_png(shot)[0] == 1200, done.stderr
