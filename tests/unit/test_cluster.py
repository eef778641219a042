"""Cluster launch files: `shardtune slurm` (an sbatch script) and `shardtune plan --emit pytorchjob`.

The sbatch script is run for real by bash, with a fake `srun` and `scontrol` on PATH that start the per-node
command on this host with the SLURM_* variables a real allocation sets, and a recording stand-in for shardtune
(SHARDTUNE_CMD, which the script honours): what each node would run, with which rendezvous and node rank.
"""

from __future__ import annotations

import itertools
import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, one_line_error

TINY = str(ROOT / "examples" / "tiny.yaml")

FAKE_SRUN = """#!/bin/bash
# Slurm's srun, for one host: start the command once per node of the allocation, as srun's tasks, with the
# variables srun sets per task; exit with the largest exit code.
while [ "${1:-}" != "${1#-}" ]; do shift; done
pids=()
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_STEP_ID=0 "$@" &
  pids+=($!)
done
code=0
for p in "${pids[@]}"; do wait "$p"; c=$?; [ "$c" -gt "$code" ] && code=$c; done
exit "$code"
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") echo 127.0.0.1; echo 127.0.0.2 ;;
  requeue*) echo "$2" >> "$FAKE_LOG/requeued" ;;
  *) exit 1 ;;
esac
"""
RECORDER = """#!/bin/bash
# Stands in for `python -m shardtune`: records each node's arguments and its NCCL / cache variables, exits $FAKE_EXIT.
printf '%s\\n' "$@" > "$FAKE_LOG/node$SLURM_NODEID.args"
env | grep -E '^(NCCL_|SHARDTUNE_CACHE=)' | sort > "$FAKE_LOG/node$SLURM_NODEID.env"
exit "${FAKE_EXIT:-0}"
"""


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _script(cli, tmp_path: Path, *extra: str) -> Path:
    proc = cli("slurm", TINY, "train.max_steps=3", "--nodes", "2", "--gpus-per-node", "2", "--partition", "gpu",
               "--time", "1:00:00", "--account", "proj", "--output-dir", str(tmp_path / "run"), *extra)
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "job.sbatch"
    path.write_text(proc.stdout)
    return path


def test_sbatch_script_lines(cli, tmp_path):
    path = _script(cli, tmp_path)
    text = path.read_text()
    subprocess.run(["bash", "-n", str(path)], check=True)
    for line in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --partition=gpu", "#SBATCH --time=1:00:00", "#SBATCH --account=proj", "#SBATCH --requeue",
                 "#SBATCH --signal=TERM@120", "export HF_HUB_OFFLINE=1", "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
                 f"export SHARDTUNE_CACHE={shlex.quote(str(tmp_path / 'run' / 'data-cache'))}"]:
        assert line + "\n" in text, line
    srun = text[text.index("\nsrun "):text.index("SRUN_PID=")]
    assert '--ntasks-per-node=1' in srun and '--node-rank "$SLURM_NODEID"' in srun
    assert f"train {TINY} train.max_steps=3 --output-dir {tmp_path / 'run'} --nproc 2 --nnodes 2 --resume auto" \
        in srun
    assert '--rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID"' in srun
    assert (tmp_path / "run").is_dir()  # the job's log goes there: Slurm needs the folder when the job starts
    for secret in ("HF_TOKEN", "WANDB_API_KEY", "AWS_"):
        assert secret not in text


SECRETS = {"HF_TOKEN": "hf_s3cret", "WANDB_API_KEY": "wandb_s3cret", "AWS_SECRET_ACCESS_KEY": "aws_s3cret",
           "NCCL_PLUGIN_TOKEN": "nccl_tok_s3cret", "NCCL_IB_SECRET": "nccl_ib_s3cret"}


def test_sbatch_script_carries_nccl_settings_and_no_secrets(cli, tmp_path, monkeypatch):
    """The NCCL_* variables of the shell that writes the script reach every node, values quoted; tokens and keys
    (also an NCCL_*_TOKEN / _SECRET) never appear in the file."""
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0 mlx5_1")
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    text = _script(cli, tmp_path).read_text()
    assert "export NCCL_SOCKET_IFNAME=ib0\n" in text and "export NCCL_IB_HCA='mlx5_0 mlx5_1'\n" in text
    for name, value in SECRETS.items():
        assert name not in text and value not in text, name


def test_sbatch_script_cache_is_the_configs_cache_dir(cli, tmp_path):
    cache = tmp_path / "shared" / "tok cache"
    text = _script(cli, tmp_path, f"data.cache_dir={cache}").read_text()
    assert f"export SHARDTUNE_CACHE={shlex.quote(str(cache))}\n" in text
    assert str(tmp_path / "run" / "data-cache") not in text


@pytest.mark.parametrize("exit_code, requeued", [(0, False), (143, True)])
def test_sbatch_script_runs_one_launcher_per_node(cli, tmp_path, monkeypatch, exit_code, requeued):
    """The script under bash with a fake srun: every node gets the same job, its own SLURM_NODEID as node rank,
    the first node of the allocation as rendezvous, the job id as rendezvous id; 143 (stopped with a checkpoint
    by the SIGTERM Slurm sends before the time limit) requeues the job, and the job's exit code is the nodes'."""
    for name in [k for k in os.environ if k.startswith("NCCL_")]:  # this machine's own: not part of the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    path = _script(cli, tmp_path)
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    _executable(bin_dir / "srun", FAKE_SRUN)
    _executable(bin_dir / "scontrol", FAKE_SCONTROL)
    recorder = _executable(tmp_path / "record", RECORDER)
    outside = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_") and k != "SHARDTUNE_CACHE"}
    env = {**outside, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[01-02]", "SHARDTUNE_CMD": shlex.quote(str(recorder)),
           "SHARDTUNE_RDZV_PORT": "29611", "FAKE_LOG": str(log), "FAKE_EXIT": str(exit_code)}
    proc = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == exit_code, proc.stderr
    for node in (0, 1):
        args = (log / f"node{node}.args").read_text().split("\n")[:-1]
        assert args[:2] == ["train", TINY] and "train.max_steps=3" in args
        pairs = dict(itertools.pairwise(args))
        assert pairs["--node-rank"] == str(node)
        assert pairs["--nnodes"] == "2" and pairs["--nproc"] == "2" and pairs["--resume"] == "auto"
        assert pairs["--rdzv-endpoint"] == "127.0.0.1:29611" and pairs["--rdzv-id"] == "4242"
        assert pairs["--output-dir"] == str(tmp_path / "run")
        # Exported by the script itself: the shell that ran it had neither.
        assert (log / f"node{node}.env").read_text() == (f"NCCL_SOCKET_IFNAME=ib0\n"
                                                        f"SHARDTUNE_CACHE={tmp_path / 'run' / 'data-cache'}\n")
    assert ((log / "requeued").read_text() == "4242\n") if requeued else not (log / "requeued").exists()


@pytest.mark.parametrize("args, fragment", [
    (["--nodes", "0", "--gpus-per-node", "2"], "--nodes 0"),
    (["--nodes", "two", "--gpus-per-node", "2"], "--nodes two"),
    (["--nodes", "2"], "--gpus-per-node: missing"),
    (["--gpus-per-node", "2"], "--nodes: missing"),
    (["--nodes", "2", "--gpus-per-node", "2", "--time", "soon"], "--time 'soon'"),
    (["--nodes", "2", "--gpus-per-node", "2", "train.lr=x"], "train.lr"),
])
def test_slurm_bad_input(cli, tmp_path, args, fragment):
    one_line_error(cli("slurm", TINY, "--output-dir", str(tmp_path / "run"), *args), fragment)


def test_slurm_submit_without_sbatch(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    one_line_error(cli("slurm", TINY, "--nodes", "2", "--gpus-per-node", "2", "--output-dir", str(tmp_path / "r"),
                       "--submit"), "sbatch not found")


def test_pytorchjob_manifest(cli):
    proc = cli("plan", TINY, "train.max_steps=3", "--emit", "pytorchjob", "--nodes", "3", "--gpus-per-node", "8",
               "--image", "registry.example/shardtune:1")
    assert proc.returncode == 0, proc.stderr
    job = yaml.safe_load(proc.stdout)
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    spec = job["spec"]
    assert spec["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 3, "maxReplicas": 3, "maxRestarts": 3,
                                     "nProcPerNode": 8}
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 3
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch" and container["image"] == "registry.example/shardtune:1"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
    command = container["command"]
    assert '--rdzv-endpoint "$PET_RDZV_ENDPOINT"' in command[2]
    train = command[command.index("train"):]
    assert train[1] == "/shardtune/tiny.yaml" and "train.max_steps=3" in train
    pairs = dict(itertools.pairwise(train))
    assert pairs["--nnodes"] == "3" and pairs["--nproc"] == "8" and pairs["--resume"] == "auto"
    assert pairs["--output-dir"].startswith("/shardtune/")
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["output"] == "/shardtune"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "persistentVolumeClaim" in volumes["output"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]
    # The tokenization cache on the shared output volume, beside the run dir
    assert {"name": "SHARDTUNE_CACHE", "value": f"{pairs['--output-dir']}/data-cache"} in container["env"]


@pytest.mark.parametrize("args, fragment", [
    (["--nodes", "0", "--gpus-per-node", "8", "--image", "x"], "--nodes 0"),
    (["--nodes", "2", "--image", "x"], "--gpus-per-node: missing"),
    (["--nodes", "2", "--gpus-per-node", "8"], "--image"),
])
def test_pytorchjob_bad_input(cli, args, fragment):
    one_line_error(cli("plan", TINY, "--emit", "pytorchjob", *args), fragment)


# --- train's multi-node flags: bad input and a rendezvous that never completes -----------------------------------

@pytest.mark.parametrize("args, fragment", [
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29500"], "--node-rank 2: out of range"),
    (["--nnodes", "2", "--node-rank", "-1", "--rdzv-endpoint", "127.0.0.1:29500"], "--node-rank -1: out of range"),
    (["--nnodes", "0"], "--nnodes 0"),
    (["--nnodes", "2", "--node-rank", "1"], "give --rdzv-endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1"], "expected HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "no-such-host.invalid:29500"], "cannot resolve no-such-host.invalid"),
])
def test_train_multi_node_bad_input(cli, tmp_path, args, fragment):
    one_line_error(cli("train", TINY, "--output-dir", str(tmp_path / "run"), *args), fragment)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rendezvous_that_never_completes_is_one_line(cli, tmp_path, monkeypatch, capsys):
    """Node rank 1 whose endpoint nobody serves: it waits SHARDTUNE_RDZV_TIMEOUT seconds for it, then one line,
    before the config is even read. The node that serves the endpoint, when the other never comes: torchrun's join
    timeout (set from the same variable), then one line, exit 2 (the launcher itself; no worker starts)."""
    import time

    from shardtune.launch import LaunchOptions, run_torchrun, torchrun_args

    for key in ("OMP_NUM_THREADS", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "SHARDTUNE_LAUNCHER_PID", "PYTHONUNBUFFERED"):
        # The in-process launcher sets these; restored after the test. setenv records an absent key as absent
        # (delenv(raising=False) of an absent key records nothing: the launcher's value stayed, see conftest).
        present = key in os.environ
        monkeypatch.setenv(key, os.environ.get(key, ""))
        if not present:
            monkeypatch.delenv(key)
    monkeypatch.setenv("SHARDTUNE_RDZV_TIMEOUT", "2")
    endpoint = f"127.0.0.1:{_free_port()}"
    start = time.monotonic()
    one_line_error(cli("train", TINY, "--output-dir", str(tmp_path / "a"), "--nnodes", "2", "--node-rank", "1",
                       "--rdzv-endpoint", endpoint), f"--rdzv-endpoint {endpoint}: nothing answered there within 2 s")
    capsys.readouterr()
    opts = LaunchOptions(nnodes=2, node_rank=0, rdzv_endpoint=endpoint, rdzv_timeout=2)
    code = run_torchrun(torchrun_args(1, ["--version"], opts), 1)
    assert time.monotonic() - start < 30
    err = capsys.readouterr().err
    one_line_error(type("P", (), {"returncode": code, "stderr": err})(),
                   f"rendezvous at {endpoint} failed within 2 s (RendezvousTimeoutError)")
