"""Launch files for clusters: a Slurm batch script and a Kubeflow PyTorchJob manifest.

Both run the same command on every node: `shardtune train CONFIG --nnodes N ...` with torchrun's c10d
rendezvous, `--resume auto`, so a job that is preempted or requeued continues from its newest complete
checkpoint. Pure text: nothing here starts a process or reads a config.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardtune.errors import ShardtuneError

RDZV_PORT = 29500
# Slurm sends this to every process of the job's steps this many seconds before the time limit; shardtune's
# launcher and workers finish the step, checkpoint and exit 143 (stop.py), and the script requeues the job.
STOP_SIGNAL_LEAD_S = 120
STOPPED_BY_SIGTERM = 143
# The environment every node gets. No secrets: tokens and keys are never written into a job file.
NODE_ENV = {
    "HF_HUB_OFFLINE": "1",  # nodes never download: models and data are on shared storage
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",  # each node's lines reach the job log as they are printed
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a collective that fails (a dead node) ends the job, never hangs it
}
# The tokenization cache (SHARDTUNE_CACHE) under the run dir when the config names none (data.cache_dir): the run
# dir is on storage every node sees, so the first node's launcher tokenizes and the others wait for it (its lock).
CACHE_SUBDIR = "data-cache"
# Variables of the writing environment that reach every node (the network NCCL was set up for there); never these:
SECRET_NAMES = ("HF_TOKEN", "WANDB_API_KEY")
SECRET_PREFIXES = ("AWS_",)
SECRET_SUFFIXES = ("_KEY", "_TOKEN", "_SECRET")
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")  # sbatch's forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S


@dataclass(frozen=True)
class Job:
    """What every node runs. `config` and `output_dir` should be absolute paths on storage all nodes share."""

    config: str
    output_dir: str
    nodes: int
    gpus_per_node: int
    overrides: list[str] = field(default_factory=list)
    name: str = "shardtune"
    cache_dir: str | None = None  # the config's data.cache_dir; None: under output_dir

    def cache(self) -> str:
        """SHARDTUNE_CACHE for every node: data.cache_dir, else OUTPUT_DIR/data-cache (storage all nodes share)."""
        return self.cache_dir or f"{self.output_dir}/{CACHE_SUBDIR}"

    def check(self) -> None:
        if self.nodes < 1:
            raise ShardtuneError(f"--nodes {self.nodes}: expected a positive number of nodes")
        if self.gpus_per_node < 1:
            raise ShardtuneError(f"--gpus-per-node {self.gpus_per_node}: expected a positive number of GPUs per node")

    def train_args(self) -> list[str]:
        """`shardtune train`'s arguments common to every node (the rendezvous and node rank come per launcher)."""
        return ["train", self.config, *self.overrides, "--output-dir", self.output_dir,
                "--nproc", str(self.gpus_per_node), "--nnodes", str(self.nodes), "--resume", "auto"]


def is_secret(name: str) -> bool:
    """A variable that must never be written into a job file (tokens, keys, cloud credentials)."""
    upper = name.upper()
    return upper in SECRET_NAMES or upper.startswith(SECRET_PREFIXES) or upper.endswith(SECRET_SUFFIXES)


def nccl_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The NCCL_* variables of `environ` (names and values, sorted), without secrets."""
    return {k: v for k, v in sorted(environ.items()) if k.startswith("NCCL_") and not is_secret(k)}


def sbatch_script(job: Job, python: str, *, partition: str | None = None, time: str | None = None,
                  account: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """An sbatch script: one `shardtune train` per node through srun, rendezvous on the allocation's first node.

    SHARDTUNE_CMD (environment) replaces the command that starts shardtune (default: `python -m shardtune` with
    the interpreter that wrote the script), and SHARDTUNE_RDZV_PORT the rendezvous port. The NCCL_* variables of
    `environ` (the environment that writes the script) are exported on every node.
    """
    job.check()
    if time is not None and not _TIME.match(time):
        raise ShardtuneError(f"--time {time!r}: expected sbatch's form, e.g. 90, 4:00:00 or 1-12:00:00")
    headers = [f"--job-name={job.name}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
               f"--gpus-per-node={job.gpus_per_node}",
               *([f"--partition={partition}"] if partition else []),
               *([f"--time={time}"] if time else []),
               *([f"--account={account}"] if account else []),
               "--requeue", f"--signal=TERM@{STOP_SIGNAL_LEAD_S}", "--open-mode=append",
               f"--output={job.output_dir}/slurm-%j.out"]
    q = shlex.quote
    train = " ".join(q(a) for a in job.train_args())
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {h}" for h in headers),
        "# Written by `shardtune slurm`. Submit with: sbatch THIS_FILE",
        "# On preemption or SIGTERM before the time limit every node finishes its step, writes a checkpoint and",
        f"# exits {STOPPED_BY_SIGTERM}; the job is then requeued and continues with --resume auto.",
        "set -uo pipefail",
        "",
        *(f"export {k}={q(v)}" for k, v in NODE_ENV.items()),
        "# The tokenization cache, on storage every node sees: one node tokenizes, the others wait for it.",
        f"export SHARDTUNE_CACHE={q(job.cache())}",
        "# Set NCCL_SOCKET_IFNAME / NCCL_IB_HCA here if NCCL picks the wrong network interface.",
        *(f"export {k}={q(v)}" for k, v in nccl_env(environ or {}).items()),
        "",
        f"read -ra SHARDTUNE <<< \"${{SHARDTUNE_CMD:-{q(python)} -m shardtune}}\"",
        'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"RDZV_PORT=${{SHARDTUNE_RDZV_PORT:-{RDZV_PORT}}}",
        f"mkdir -p {q(job.output_dir)}",
        "",
        "# One task per node; each names its node rank (SLURM_NODEID, known only inside the task).",
        'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \\',
        "  bash -c 'exec \"$@\" --node-rank \"$SLURM_NODEID\"' node \\",
        f'  "${{SHARDTUNE[@]}}" {train} \\',
        '  --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID" &',
        "SRUN_PID=$!",
        "# The batch shell outlives a SIGTERM meant for the steps, so it can requeue after their checkpoint.",
        "trap 'echo \"shardtune: SIGTERM: waiting for the nodes to checkpoint\" >&2' TERM",
        'while true; do wait "$SRUN_PID"; code=$?; kill -0 "$SRUN_PID" 2>/dev/null || break; done',
        f'if [ "$code" -eq {STOPPED_BY_SIGTERM} ]; then',
        '  echo "shardtune: stopped with a checkpoint; requeueing job $SLURM_JOB_ID" >&2',
        '  scontrol requeue "$SLURM_JOB_ID" || true',
        "fi",
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def pytorchjob(job: Job, image: str, *, python: str = "python") -> dict[str, Any]:
    """A Kubeflow training-operator PyTorchJob: one pod per node, each running torchrun's c10d rendezvous through
    `shardtune train` (the operator sets PET_* for torchrun; shardtune is given them explicitly so the command reads
    the same as on Slurm), the output dir on a shared volume (a ReadWriteMany PersistentVolumeClaim)."""
    job.check()
    if not image:
        raise ShardtuneError("--image: give the container image that has shardtune installed")
    mount = "/shardtune"
    # With an elasticPolicy the operator gives each pod PET_RDZV_ENDPOINT: the first worker's service and port.
    command = ["bash", "-c", 'exec "$@" --rdzv-endpoint "$PET_RDZV_ENDPOINT"', "node",
               python, "-m", "shardtune", *job.train_args(), "--rdzv-id", job.name]
    container = {
        "name": "pytorch",  # the training operator finds the training container by this name
        "image": image,
        "command": command,
        "env": [{"name": k, "value": v} for k, v in {**NODE_ENV, "SHARDTUNE_CACHE": job.cache()}.items()],
        "resources": {"limits": {"nvidia.com/gpu": job.gpus_per_node},
                      "requests": {"nvidia.com/gpu": job.gpus_per_node}},
        "volumeMounts": [{"name": "output", "mountPath": mount}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    replica = {
        "replicas": job.nodes,
        "restartPolicy": "OnFailure",  # a restarted pod rejoins the rendezvous and resumes (--resume auto)
        "template": {"spec": {
            "containers": [container],
            "volumes": [{"name": "output", "persistentVolumeClaim": {"claimName": f"{job.name}-output"}},
                        # NCCL and the data loaders use shared memory; a pod's default 64 MiB is too small
                        {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        }},
    }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": job.name},
        "spec": {
            "elasticPolicy": {"rdzvBackend": "c10d", "minReplicas": job.nodes, "maxReplicas": job.nodes,
                              "maxRestarts": 3, "nProcPerNode": job.gpus_per_node},
            "pytorchReplicaSpecs": {"Worker": replica},
        },
    }
