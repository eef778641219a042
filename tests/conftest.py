from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shardtune.models.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
# One inductor cache for the whole run, this process and every process it starts: kernels (and the precompiled
# header, ~10-20 s of C++ on CPU) compiled by one test are reused by the next, across processes and runs.
INDUCTOR_CACHE = str(ROOT / ".pytest_cache" / "inductor")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", INDUCTOR_CACHE)
# DeepSpeed's JIT-built ops (cpu_adam; async_io where asked) in the clone too, not in ~/.cache/torch_extensions: a
# build left there by an earlier checkout counts as built (the NVMe variant then runs) while ninja rebuilds it
# against the fresh venv's newer source files (CI stop 23: the NVMe tests ran and the DeepSpeed launch took 990 s,
# 82-95 s in a fresh clone here). A fresh clone now builds what it needs, and skips the NVMe variant as listed.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".pytest_cache" / "torch_extensions"))
# Workers forked from a forkserver that imported torch, transformers and the loop once (shardtune/workerstart.py):
# each launch's workers skip ~6-8 CPU-s of imports each, and launches in this process (run_cli) share one
# forkserver for the session. SHARDTUNE_WORKER_START= (empty) runs the tests with Popen'd workers.
os.environ.setdefault("SHARDTUNE_WORKER_START", "forkserver")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    # One inductor cache per thread count: Inductor's CPU kernels depend on it and its cache key does not say so.
    # (Found with FlexAttention's CPU kernel, which test_packed_attention no longer uses: it is wrong by itself.)
    env["TORCHINDUCTOR_CACHE_DIR"] = f"{INDUCTOR_CACHE}-omp{env['OMP_NUM_THREADS']}"
    return env


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, parents before children (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _kill_tree(pid: int) -> None:
    # By process tree, not process group: torchrun starts each worker in a session of its own.
    for p in descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def run(cmd: list[str], timeout: float = 600, cwd: Path = ROOT,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a command (with `env` added to the environment), returning its completed process (text output).

    On a timeout or an interrupt the command's whole process tree is killed: killing only torchrun left its
    workers, and the DeepSpeed op build one of them had started, running long after the test had failed."""
    with subprocess.Popen(cmd, cwd=cwd, env=_env(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:  # stdin: not the test runner's (xdist's pipe)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            _kill_tree(proc.pid)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(nproc: int, script_and_args: list[str], timeout: float = 600,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Launch a script on `nproc` gloo processes with torchrun; fail the test with its output if it fails.

    With SHARDTUNE_WORKER_START=forkserver (the default here) torchrun's agent runs in this process and forks the
    workers from the session's preloaded forkserver (`_torchrun_here`); otherwise `python -m torch.distributed.run`
    starts them."""
    args = ["--standalone", f"--nproc-per-node={nproc}", *script_and_args]
    from shardtune import workerstart

    if workerstart.wanted():
        proc = _torchrun_here(args, timeout, env)
    else:
        proc = run([sys.executable, "-m", "torch.distributed.run", *args], timeout, env=env)
    if proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                    f"--- stderr\n{proc.stderr[-8000:]}")
    return proc


def _torchrun_here(args: list[str], timeout: float, env: dict[str, str] | None) -> subprocess.CompletedProcess:
    """torchrun ARGS with its agent in this process (`in_this_process`) and the workers forked from the session's
    forkserver, which imported torch, transformers and the loop once (shardtune/workerstart.py): ~6-8 CPU-s of
    imports saved per worker, and the launcher's own interpreter start. A worker that outlives `timeout` is killed,
    so the launch fails as a Popen'd one would."""
    import threading
    import traceback

    import torch.distributed.run as torchrun_module

    from shardtune import workerstart

    code = 1
    with in_this_process(env) as output:
        server = workerstart.start_forkserver()
        before = set(descendants(server))
        watchdog = threading.Timer(timeout, lambda: [_kill_tree(p) for p in set(descendants(server)) - before])
        watchdog.start()
        try:
            workerstart.launch(torchrun_module.parse_args(args))
            code = 0
        except Exception:  # a worker failed (ChildFailedError) or the launch did: its output says which
            traceback.print_exc()
        finally:
            watchdog.cancel()
    out, err = output()
    return subprocess.CompletedProcess(["torchrun", *args], code, out, err)


def one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    """The promise for bad input: exit code 2, one `error:` line naming the problem, no traceback."""
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def shardtune(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The real console entry point, as a user runs it."""
    return run([sys.executable, "-m", "shardtune", *args], timeout)


class Payload:
    """Unpickling this runs `touch MARKER` (os.system), as a planted checkpoint file would."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[[str], int], tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def offload_test_model(overrides: list[str], device: str = "cpu", offload: bool = False) -> tuple[Any, list, Any]:
    """examples/tiny.yaml's model for the activation-offload tests (CPU and GPU): weights N(0, 0.05) from seed 0,
    in train mode, then the offload hooks (every saved tensor, min_bytes 0) where `offload`, then the
    checkpointing and compile `overrides` set. (model, its blocks, the hooks or None)"""
    import torch

    from shardtune.config import load_config
    from shardtune.models.build import build_on_meta, load_hf_config, restore_buffers
    from shardtune.parallel import prepare

    cfg = load_config(str(ROOT / "examples" / "tiny.yaml"), overrides)
    model = build_on_meta(load_hf_config(cfg.model), "sdpa").to_empty(device=device)
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    restore_buffers(model, torch.device(device))
    model.train()
    blocks = list(model.model.layers)
    until = prepare.first_left_out(blocks, cfg.parallel)  # parallel.checkpoint_blocks: the hooks off from there
    hooks = prepare.offload_activations(model, blocks, device, min_bytes=0, until=until) if offload else None
    prepare.checkpoint_and_compile(model, blocks, cfg.parallel, device)
    return model, blocks, hooks


def two_steps(model: Any, ids: Any, before_each: Callable[[], None] = lambda: None) -> tuple[list[float], dict]:
    """Two training steps' losses (input_ids = labels = `ids`) and the gradients summed over them, by parameter
    name (those that got one)."""
    losses = []
    for _ in range(2):
        before_each()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def block_saved_bytes(model: Any, batch: int, seq: int) -> int:
    """Bytes autograd saves in the forward of `model`'s first decoder block (a Hugging Face Llama-style model) on a
    random input of batch x seq tokens, each storage once; its parameters and the cos / sin tables every layer
    shares left out."""
    import torch

    hidden = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randn(batch, seq, hidden, dtype=dtype, requires_grad=True)
    pos = torch.arange(seq)[None].expand(batch, seq)
    cos, sin = model.model.rotary_emb(x, pos)
    shared = {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in shared:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](x, position_embeddings=(cos, sin), position_ids=pos, attention_mask=None)
    return sum(saved.values())


@pytest.fixture
def without_inductor(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile with the aot_eager backend for this test: Dynamo's graphs, AOTAutograd's partition (the same
    min-cut partitioner, so what a checkpoint or a memory budget saves) and eager kernels, without Inductor's C++
    code generation (20-30 s a test on a cold CI cache). For tests of what is traced and saved; Inductor's own code
    runs in the 2-process parity variants (tests/dist/worker.py's compile ones) and on the GPU."""
    import functools

    import torch

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))


def max_diff(a: list[float], b: list[float], min_len: int = 6) -> float:
    """Largest difference of two loss trajectories of the same length (at least min_len steps)."""
    assert len(a) == len(b) >= min_len
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def assert_same_gradients(ref: dict, run: dict, rtol: float = 1e-5) -> None:
    """Same training as the reference, to the gradient: losses within 1e-5 and every step's grad norm (before
    clipping) within `rtol`. The norm sees a gradient-scale error (a lost `* world`, a wrong accumulation
    normaliser) that clipping and Adam's scale invariance hide from the loss."""
    assert max_diff(ref["losses"], run["losses"]) < 1e-5
    assert len(ref["grad_norms"]) == len(run["grad_norms"]) >= 6
    assert run["grad_norms"] == pytest.approx(ref["grad_norms"], rel=rtol, abs=0)


# --- Multi-process runs that several test modules compare against: one launch each per session ------------------
WORKER = str(ROOT / "tests" / "dist" / "worker.py")
# The 0.13M-parameter preset for tests whose checks do not depend on the model's size (a launch ~3 s instead of
# ~8.5 s with tiny-llama, whose compute dominates): the override, and its decoder blocks and the 7 projections of
# each that LoRA adapts (tests/dist/worker.py trains it).
MICRO = "model.preset=micro-llama"
LAYERS = PRESETS["micro-llama"]["num_hidden_layers"]
PROJECTIONS = 7  # q, k, v, o, gate, up, down: a llama block's linear layers
# tests/dist/worker.py's variants (strategy[:option...]) in the FSDP2 reference launches: one process with
# grad_accum 4 and two processes with grad_accum 2 see the same global batches.
# Micro-batch 2 (the worker's BASE): a global batch of 8; ddp:mb8 (1 x 8 x 1) and zero3:mb1 (2 x 1 x 4) split
# it otherwise.
# zero3:compile runs in both launches: the one-process run compiles the decoder block's graphs (~50 s of Inductor on a
# CPU core) into the session's Inductor cache, where the two ranks of the second launch find them instead of both
# compiling the same graphs at once (107 s there in CI stop 24's tree).
ONE_PROCESS_VARIANTS = ["ddp", "ddp:packed", "ddp:lora", "ddp:qlora", "ddp:adamw8bit", "zero3:qlora", "ddp:noclip",
                        "ddp:mb8", "zero3:compile:aot", "zero3:lora:local"]
TWO_PROCESS_VARIANTS = ["ddp", "zero2", "zero3", "zero3:ac", "zero3:compile", "zero3:ac:compile",
                        "zero3:ac:compile:around", "zero3:compile:budget", "zero3:ac:actoff",
                        "zero3:compile:budget:actoff", "zero3:ac:cb1", "zero3:ac:compile:cb1:aot",
                        "zero3:ac:cb1:actoff", "zero3:ac:tile:actoff", "zero3:dir",
                        "zero3:packed",
                        "ddp:packed", "ddp:lora", "zero2:lora", "zero3:lora", "zero3:lora:bf16", "zero3:bf16",
                        "zero2:fp16", "zero3:qlora", "zero3:adamw8bit", "zero3:noclip", "zero3:mb1",
                        "zero3:lora:local", "zero3:lora:bf16:local", "zero3:qlora:local", "zero3:qlora:ac:compile:aot"]


def worker_results(out: Path, nproc: int, grad_accum: int, variants: list[str],
                   env: dict[str, str] | None = None) -> dict[str, dict]:
    """Run tests/dist/worker.py's variants in one launch of `nproc` processes; their results by variant."""
    torchrun(nproc, [WORKER, str(out), str(grad_accum), *variants], timeout=1500, env=env)  # cold op builds
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="session")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sharded HF directory (several safetensors files + index) holding the micro-llama preset's own weights (the
    preset tests/dist/worker.py trains)."""
    from shardtune.models.init_model import init_model

    model_dir = init_model(tmp_path_factory.mktemp("model") / "micro", "micro-llama", max_shard_bytes=150_000)
    assert (model_dir / "model.safetensors.index.json").is_file()
    return model_dir


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tokenization cache (data.cache_dir) for this worker's runs: entries are keyed by the data, tokenizer and
    settings, so runs of other data add their own. A 2-process launch that tokenizes the shipped tasks again spends
    ~4.5 s of its 8-12 s on it. Tests of the cache itself, or of runs tokenizing at once, use their own."""
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="session")
def fsdp2_runs(tmp_path_factory: pytest.TempPathFactory, micro_model_dir: Path) -> tuple[dict, dict]:
    """(one process, two processes): the FSDP2 variants' results, shared by the parity and DeepSpeed tests."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    # MLflow 3 refuses a file store unless told (the zero3 variant logs to one); wandb: no banner lines.
    env = {"SHARDTUNE_TEST_MODEL_DIR": str(micro_model_dir), "MLFLOW_ALLOW_FILE_STORE": "true", "WANDB_SILENT": "true"}
    one = worker_results(tmp / "one", 1, 4, ONE_PROCESS_VARIANTS, env)
    two = worker_results(tmp / "two", 2, 2, TWO_PROCESS_VARIANTS, env)
    return one, two


@dataclass
class CliResult:
    """What an in-process `shardtune` command returned and printed (the fields of a CompletedProcess)."""

    returncode: int
    stdout: str
    stderr: str


_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


@contextlib.contextmanager
def in_this_process(env: dict[str, str] | None = None) -> Iterator[Callable[[], tuple[str, str]]]:
    """Run a command's code here as a subprocess would run it, and put this process back afterwards.

    Inside: the environment `run` gives a subprocess (one thread per process, offline, plus `env`), the repository
    as working directory, and stdout/stderr captured at the file descriptors, so the lines of the processes the
    command starts (torchrun's workers) are caught too. The yielded function returns (stdout, stderr) once the
    block has ended. Afterwards the environment (the launcher sets variables for its workers), the working
    directory and the signal handlers (torchrun's agent installs its own) are what they were: one command cannot
    leak into the next test."""
    saved_env, cwd = dict(os.environ), os.getcwd()
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    captured: dict[str, str] = {}
    os.environ.update(_env(env))
    os.chdir(ROOT)
    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
        sys.stdout.flush()
        sys.stderr.flush()
        fds = os.dup(1), os.dup(2)
        os.dup2(out_f.fileno(), 1)
        os.dup2(err_f.fileno(), 2)
        py_out, py_err = sys.stdout, sys.stderr
        sys.stdout = open(1, "w", closefd=False, buffering=1)  # noqa: SIM115 - closed in the finally below
        sys.stderr = open(2, "w", closefd=False, buffering=1)  # noqa: SIM115
        try:
            yield lambda: (captured["out"], captured["err"])
        finally:
            sys.stdout.close()
            sys.stderr.close()
            sys.stdout, sys.stderr = py_out, py_err
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            os.close(fds[0])
            os.close(fds[1])
            os.environ.clear()
            os.environ.update(saved_env)
            os.chdir(cwd)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            for name, f in (("out", out_f), ("err", err_f)):
                f.seek(0)
                captured[name] = f.read().decode(errors="replace")


def run_cli(*args: str, env: dict[str, str] | None = None) -> CliResult:
    """`shardtune ARGS` in this process: `cli.main` as the console script calls it, with everything it and the
    processes it starts printed (see `in_this_process`). No interpreter start for the command itself (5-10 s of
    imports with torch and transformers): a `train` runs its launcher (validate, plan, the run-dir lock,
    torchrun's agent) here and its workers as the real command does. A `train` writes no run report unless the
    arguments set log.report."""
    from shardtune.cli import main

    if args and args[0] == "train" and not any(a.startswith("log.report=") for a in args):
        # The run report's plots (matplotlib, ~2 s of a 8-step launch's 8-10 s) only where a test reads them:
        # tests/dist/test_report.py, and the README demo's own subprocess run (test_demo.py), keep it on.
        args = (*args, "log.report=false")
    with in_this_process(env) as output:
        try:
            code = main(list(args))
        except SystemExit as err:  # argparse's usage errors exit 2, as the console script would
            code = err.code if isinstance(err.code, int) else int(err.code is not None)
    return CliResult(code, *output())


@pytest.fixture
def cli() -> Callable[..., CliResult]:
    """`run_cli` as a fixture: `shardtune ARGS` in the test's own process. The smoke tests in test_cli.py and
    test_demo.py, and the tests that signal or kill the launcher, run the real command in a subprocess."""
    return run_cli


# --- No test leaves launcher state in this process's environment ---------------------------------------------------
# The launcher marks its workers' environment (SHARDTUNE_LAUNCHER_PID: a worker whose parent is not that process
# has lost its launcher; the run-dir lock's key). Left in this process by one test, they reach the next test's
# subprocesses: a `torchrun -m shardtune` worker then took another process for its launcher and exited (the
# parallel-only failure of test_started_by_torchrun_directly, after test_cluster's in-process launch). Commands run
# in-process through `in_this_process`, which puts the environment back; this fails a test that changed it anyway.
# (The rank variables that an in-process single-rank process group sets stay: that group lives for the session.)


def _launch_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("SHARDTUNE_")}


_SESSION_LAUNCH_ENV = _launch_env()  # as this process started (conftest is imported before any test runs)


def _put_back(env: dict[str, str]) -> list[str]:
    now = _launch_env()
    for key in now.keys() - env.keys():
        del os.environ[key]
    os.environ.update(env)
    return sorted(k for k in now.keys() | env.keys() if now.get(k) != env.get(k))


@pytest.fixture(autouse=True)
def _no_launcher_env_left_behind() -> Iterator[None]:
    # Compared with the session's start before the test too: a module- or session-scoped fixture that ran a
    # training here (taking the run-dir lock sets SHARDTUNE_RUN_LOCK) is set up before this function fixture, and
    # would otherwise show up only in whichever later test happened to change that variable (CI, stop 23).
    changed = _put_back(_SESSION_LAUNCH_ENV)
    if changed:
        pytest.fail(f"a fixture of this test (or one of an earlier test) left {', '.join(changed)} changed in the "
                    "test process's environment: restore it when the fixture's run ends")
    yield
    changed = _put_back(_SESSION_LAUNCH_ENV)
    if changed:
        pytest.fail(f"the test left {', '.join(changed)} changed in the test process's environment (run commands "
                    "through run_cli / in_this_process, or restore it with monkeypatch)")


# --- A full disk: a small tmpfs -----------------------------------------------------------------------------------
TMPFS_SKIP = "needs root and a mountable tmpfs to fill a disk"


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's syntax: 20m) mounted at `path` for the block, unmounted afterwards however the block
    ends. Skips (visibly; not an allowed skip in CI, whose container runs as root) where it cannot be mounted."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip(TMPFS_SKIP)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(TMPFS_SKIP)
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=False)


# --- Visible skips ------------------------------------------------------------------------------------------------
# CI (CI=true) installs every extra and libaio, so a skip there means a broken install, not a missing GPU: it
# fails the run. Only what a CPU machine cannot run may skip in CI; each reason is listed with why.
NVME_SKIP = ("NVMe offload builds DeepSpeed's async_io op (~7 min of C++ on 2 cores): set SHARDTUNE_TEST_OP_BUILDS=1 "
             "to build and run it")
ALLOWED_CI_SKIPS = {
    "needs CUDA": "tests/gpu: the CI machine has no GPU",
    "needs 2 GPUs": "tests/gpu: the CI machine has no GPU (a two-GPU test says so first)",
    NVME_SKIP: "a build, not a missing install: more than half of the suite's 12-minute budget",
    "3.14's incremental collector has no full passes": "a Python version, not an install",
}


def op_built(name: str) -> bool:
    """Whether DeepSpeed's op `name` loads without a build: installed prebuilt (DS_BUILD_*=1) or JIT-built before."""
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    return bool(installed_ops.get(name)) or (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").is_file()


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr  # (path, line, "Skipped: REASON") for a skip
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _fail_skip_in_ci(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Turn a skip into a failure (a test) or a collection error (a module-level skip) unless it is allowed."""
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if reason in ALLOWED_CI_SKIPS:
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped in CI: {reason}\nCI installs every extra and libaio, so this skip means a broken "
                       "install: install what is missing (or, for what a CPU machine cannot run, add the reason to "
                       "ALLOWED_CI_SKIPS in tests/conftest.py)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


# --- CPU seconds per test ------------------------------------------------------------------------------------------
# SHARDTUNE_TEST_CPU_LOG=FILE appends one JSON line per test: the CPU seconds (user + system) of this process and
# of every child it reaped during the test's setup, call and teardown. Unlike wall time, this does not grow when
# other work shares the cores, so the suite's cost can be profiled on a busy machine (CI's 2 cores: wall ~ CPU / 2).
_CPU_LOG = os.environ.get("SHARDTUNE_TEST_CPU_LOG")


def _cpu_seconds() -> float:
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + _forkserver_cpu_seconds()


def _forkserver_cpu_seconds() -> float:
    """The session's forkserver (SHARDTUNE_WORKER_START) and the workers it reaped: this process reaps them only
    when the forkserver ends, at the end of the session."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split() if pid else []
    except OSError:
        return 0.0
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not _CPU_LOG:
        yield
        return
    import time

    cpu, wall = _cpu_seconds(), time.perf_counter()
    yield
    with open(_CPU_LOG, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "cpu_s": round(_cpu_seconds() - cpu, 2),
                            "wall_s": round(time.perf_counter() - wall, 2), "ended": round(time.time(), 1),
                            "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")


# --- Parallel runs (pytest-xdist, `-n`) ----------------------------------------------------------------------------
# Each module runs whole on one worker, so its module fixtures (its shared training runs) are made once. The modules
# that read the session's FSDP2 launches (`fsdp2_runs`) form one group, so that launch runs once too. (xdist's own
# `--dist loadgroup` cannot do this under pytest 9: its group suffix on the node id no longer reaches the scheduler.)
FSDP2_RUNS_MODULES = ("tests/dist/test_parity.py", "tests/dist/test_deepspeed.py", "tests/dist/test_comm.py",
                      "tests/dist/test_monitors.py", "tests/dist/test_report.py")


def scheduling_group(nodeid: str) -> str:
    """The group a test runs in: its module, or the one group of the modules sharing the FSDP2 launches."""
    module = nodeid.split("::", 1)[0]
    return "fsdp2_runs" if module in FSDP2_RUNS_MODULES else module


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_group(nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A module that starts reading `fsdp2_runs` must join FSDP2_RUNS_MODULES, or a parallel run makes it twice."""
    readers = [item.nodeid for item in items if "fsdp2_runs" in getattr(item, "fixturenames", ())]
    strays = sorted({nodeid.split("::", 1)[0] for nodeid in readers if scheduling_group(nodeid) != "fsdp2_runs"})
    if strays:
        raise pytest.UsageError(f"{', '.join(strays)} use(s) fsdp2_runs: add them to FSDP2_RUNS_MODULES in "
                                "tests/conftest.py")
