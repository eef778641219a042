"""`shardtune` command line: train | validate | plan | init-model | export | calibrate | report.

Bad input exits with code 2 and one line saying what is wrong and how to fix it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # shardtune never downloads at run time
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from shardtune.errors import ShardtuneError
from shardtune.runtime import quiet_library_noise

quiet_library_noise()  # every command and worker imports this module before transformers (and torchao with it)


def _nproc(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nproc {text!r}: expected a positive integer or 'auto'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--nproc {text!r}: expected a positive integer or 'auto'")
    return value


OVERWRITE_TRAIN = ("train in OUTPUT_DIR from the start even if it holds a finished run (whose summary.json and "
                   "checkpoints are removed first), and replace OUTPUT_DIR/model (or adapter) at the end even if "
                   "shardtune did not write what is there (without it, either stops the run before it starts)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardtune", description="Sharded fine-tuning of Hugging Face causal LMs.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser("train", help="fine-tune as a config says (re-executes under torchrun)")
    t.add_argument("config", help="YAML config file")
    t.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.lr=1e-4")
    t.add_argument("--nproc", type=_nproc, default=None, help="processes on this node (int or auto)")
    t.add_argument("--output-dir", default=None, help="run directory (overrides train.output_dir)")
    t.add_argument("--nnodes", type=int, default=1, help="nodes in the job (torchrun rendezvous)")
    t.add_argument("--node-rank", type=int, default=None, help="this node's rank (multi-node)")
    t.add_argument("--rdzv-endpoint", default=None, help="host:port of the rendezvous (multi-node)")
    t.add_argument("--rdzv-id", default="shardtune", help="the job's id at the rendezvous (multi-node; Slurm: the "
                                                          "job id), so two jobs on one endpoint never meet")
    t.add_argument("--resume", nargs="?", const="auto", default=None, metavar="PATH|auto",
                   help="continue from a checkpoint (auto = the newest complete one in the run directory)")
    _hardware_flags(t)
    t.add_argument("--force", action="store_true", help="run even when the planner predicts it will not fit")
    t.add_argument("--overwrite", action="store_true", help=OVERWRITE_TRAIN)
    t.add_argument("--debug", action="store_true", help="on an error, show the full traceback too")
    t.set_defaults(func=cmd_train)

    v = sub.add_parser("validate", help="check a config, its model and data without training")
    v.add_argument("config", help="YAML config file")
    v.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.lr=1e-4")
    v.add_argument("--nproc", type=_nproc, default=None, help="processes (GPUs) on this node (int or auto)")
    v.add_argument("--nnodes", type=int, default=1, help="nodes in the job")
    _hardware_flags(v)
    v.add_argument("--force", action="store_true", help="do not refuse a config the planner predicts will not fit")
    v.add_argument("--overwrite", action="store_true", help="check as `train --overwrite` would")
    v.add_argument("--debug", action="store_true", help="on an error, show the full traceback too")
    v.set_defaults(func=cmd_validate)

    pl = sub.add_parser("plan", help="predict per-GPU memory and tokens/s for every way to run a config, and pick "
                                     "the fastest that fits; --emit a DeepSpeed (HF Trainer) or accelerate config")
    pl.add_argument("config", nargs="?", help="YAML config file (not needed with --check)")
    pl.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. parallel.strategy=zero2")
    pl.add_argument("--nproc", type=_nproc, default=None, help="processes (GPUs) per node (int or auto)")
    pl.add_argument("--nnodes", type=int, default=1, help="nodes in the job")
    _hardware_flags(pl)
    pl.add_argument("--json", action="store_true", help="print the plan as JSON (candidates, pick)")
    pl.add_argument("--all", action="store_true", help="list the candidates that do not fit too, and try every "
                                                       "micro-batch size")
    pl.add_argument("--check", default=None, metavar="RUN_DIR",
                    help="compare a finished run's measured peak memory and tokens/s with its plan.json")
    pl.add_argument("--emit", default=None, metavar="deepspeed|accelerate|pytorchjob",
                    help="print a DeepSpeed JSON for transformers.TrainingArguments(deepspeed=...), an "
                         "`accelerate launch --config_file` YAML, or a Kubeflow PyTorchJob manifest (with --nodes, "
                         "--gpus-per-node, --image), to stdout (hints go to stderr)")
    pl.add_argument("--nodes", default=None, help="--emit pytorchjob: nodes (pods)")
    pl.add_argument("--gpus-per-node", default=None, help="--emit pytorchjob: GPUs per node")
    pl.add_argument("--image", default=None, help="--emit pytorchjob: a container image with shardtune installed")
    pl.set_defaults(func=cmd_plan)

    s = sub.add_parser("slurm", help="print (or --submit) an sbatch script that trains CONFIG on several nodes, "
                                     "preemption-safe (requeue, checkpoint on SIGTERM, --resume auto)")
    s.add_argument("config", help="YAML config file (on storage every node sees)")
    s.add_argument("overrides", nargs="*", help="section.key=value overrides, passed to every node")
    s.add_argument("--nodes", default=None, help="nodes in the job")
    s.add_argument("--gpus-per-node", default=None, help="GPUs (processes) per node")
    s.add_argument("--partition", default=None, help="Slurm partition (sbatch --partition)")
    s.add_argument("--time", default=None, help="time limit, sbatch's form (e.g. 4:00:00)")
    s.add_argument("--account", default=None, help="Slurm account to charge (sbatch --account)")
    s.add_argument("--output-dir", default=None, help="run directory on shared storage (overrides "
                                                      "train.output_dir)")
    s.add_argument("--submit", action="store_true", help="write the script to OUTPUT_DIR/slurm.sbatch and run "
                                                         "sbatch on it")
    s.set_defaults(func=cmd_slurm)

    m = sub.add_parser("init-model", help="write a random-init Hugging Face model directory for a preset")
    m.add_argument("out_dir", help="folder to write (config.json, tokenizer, model.safetensors)")
    m.add_argument("--preset", required=True, help="built-in shape: tiny-llama, llama-3.2-1b, llama-3-8b, ...")
    m.add_argument("--config-only", action="store_true", help="write config.json and tokenizer, no weights")
    m.add_argument("--seed", type=int, default=0, help="seed of the random init (as model.seed; default 0)")
    m.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the weights written")
    m.set_defaults(func=cmd_init_model)

    e = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    e.add_argument("checkpoint", help="a checkpoint (step-NNNNNNNN) or a run directory (its newest checkpoint)")
    e.add_argument("out_dir", help="folder to write the Hugging Face model (or PEFT adapter) into")
    e.add_argument("--dtype", choices=["auto", "bf16", "fp32", "fp16"], default="auto",
                   help="auto = fp32 for fp32 runs, else bf16")
    e.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB")
    e.add_argument("--merge-lora", action="store_true",
                   help="LoRA checkpoint: write the base model with the adapter merged in (else the adapter alone)")
    e.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR and everything in it even if shardtune did not write it (without it, a "
                        "non-empty OUT_DIR must be an earlier export of the same kind)")
    e.add_argument("--debug", action="store_true", help="on an error, show the full traceback too")
    e.set_defaults(func=cmd_export)

    c = sub.add_parser("calibrate", help="measure this GPU machine's ceilings (matmul, memory, copies, NCCL, host "
                                         "AdamW) for the planner")
    c.add_argument("--out", default=None, help="JSON file (default $SHARDTUNE_CALIBRATION or "
                                               "~/.cache/shardtune/calibration.json)")
    c.add_argument("--quick", action="store_true", help="fewer, smaller measurements (under 20 s)")
    c.add_argument("--gpu", default=None, help="the table's GPU type to start from when the local GPU's name is "
                                               "not in it")
    c.set_defaults(func=cmd_calibrate)

    r = sub.add_parser("report", help="an HTML page with plots (loss, throughput, memory, communication, "
                                      "checkpoints) of one or more runs, overlaid")
    r.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="output dirs of shardtune runs")
    r.add_argument("--out", default=None, metavar="DIR", help="where to write report.html and its PNGs "
                                                              "(default: the first RUN_DIR's report/)")
    r.set_defaults(func=cmd_report)
    return p


def _hardware_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", default=None, metavar="TYPE", help="plan for this GPU type (h200, h100, a100-80gb, ...) "
                                                               "instead of the local one")
    p.add_argument("--gpu-memory", default=None, metavar="SIZE", help="memory per GPU, e.g. 80GiB (with --gpu)")
    p.add_argument("--host-memory", default=None, metavar="SIZE",
                   help="host memory per node, e.g. 2TiB (with --gpu; default: this machine's when its GPU is used, "
                        "else not checked)")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="ceilings measured by `shardtune calibrate` (default: ~/.cache/shardtune/calibration.json)")


def hardware_from(args: argparse.Namespace, local_host: bool = False) -> Any:
    """The hardware flags resolved; `local_host`: the run starts on this machine, so its host memory counts."""
    from shardtune.plan import resolve_hardware

    return resolve_hardware(getattr(args, "gpu", None), getattr(args, "gpu_memory", None),
                            getattr(args, "calibration", None), getattr(args, "host_memory", None), local_host)


def _overrides(args: argparse.Namespace) -> list[str]:
    extra = list(args.overrides)
    resume = getattr(args, "resume", None)
    if resume is not None and "=" in resume:  # `--resume train.lr=...`: the flag had no value
        extra.insert(0, resume)
        resume = "auto"
    if resume is not None:
        extra.append(f"checkpoint.resume={resume}")
    if getattr(args, "output_dir", None):
        extra.append(f"train.output_dir={args.output_dir}")
    return extra


def cmd_train(args: argparse.Namespace) -> int:
    from shardtune.launch import (
        LaunchOptions,
        local_gpu_count,
        resolve_nproc,
        run_torchrun,
        torchrun_args,
        under_torchrun,
    )
    from shardtune.parallel import host_memory_fixes

    if under_torchrun():
        return _worker(args.config, _overrides(args), overwrite=args.overwrite, debug=args.debug)
    _check_nodes(args)
    if args.node_rank and args.rdzv_endpoint:  # the first node hosts the rendezvous; the others wait for it
        from shardtune.launch import DEFAULT_RDZV_TIMEOUT_S, wait_for_endpoint

        wait_s = int(os.environ.get(RDZV_TIMEOUT_ENV) or DEFAULT_RDZV_TIMEOUT_S)
        if not wait_for_endpoint(args.rdzv_endpoint, wait_s):
            raise ShardtuneError(f"--rdzv-endpoint {args.rdzv_endpoint}: nothing answered there within {wait_s} s; "
                                 "start node rank 0 (it hosts the rendezvous) and check the host, port and firewall "
                                 f"({RDZV_TIMEOUT_ENV} sets the wait)")
    from shardtune.config import load_config
    from shardtune.plan import auto_keys, auto_overrides
    from shardtune.validate import validate

    auto = auto_keys(load_config(args.config, _overrides(args)))
    cfg = validate(args.config, _overrides(args), nproc_flag=args.nproc, quiet=True, nnodes=args.nnodes,
                   hardware=hardware_from(args, local_host=True), force=args.force, overwrite=args.overwrite)
    nproc = resolve_nproc(args.nproc, cfg.parallel.nproc)
    if args.overwrite and not args.node_rank:
        from shardtune.checkpoint.outdir import clear_finished_run

        if clear_finished_run(cfg):
            print(f"--overwrite: removed the finished run's summary and checkpoints in {cfg.train.output_dir}",
                  flush=True)
    # The launcher's plan fixed what the config left to auto: the workers get it as overrides.
    worker_args = ["train", args.config, *_overrides(args), *auto_overrides(cfg, auto),
                   *(["--overwrite"] if args.overwrite else []), *(["--debug"] if args.debug else [])]
    if cfg.checkpoint.resume:  # validate read it back once; the workers take that checkpoint, unread again
        from shardtune.checkpoint.layout import VERIFIED_ENV

        worker_args.append(f"checkpoint.resume={cfg.checkpoint.resume}")
        os.environ[VERIFIED_ENV] = cfg.checkpoint.resume
    timeout = os.environ.get(RDZV_TIMEOUT_ENV)
    opts = LaunchOptions(nproc=nproc, nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                         rdzv_id=args.rdzv_id, rdzv_timeout=int(timeout) if timeout else None)
    from shardtune.checkpoint.runlock import lock_run_dir, release_run_dir

    out = Path(cfg.train.output_dir)
    holder = args.nnodes == 1 or args.node_rank == 0  # one node locks a shared output dir for all
    if holder:
        lock_run_dir(out)  # held by this launcher until the workers end (or it dies)
    elif args.node_rank is not None:  # node rank 0's launcher holds it, whichever node's worker is global rank 0
        from shardtune.checkpoint.runlock import LOCK_ENV

        os.environ[LOCK_ENV] = str(out.resolve())
    try:
        return run_torchrun(torchrun_args(nproc, worker_args, opts), nproc, host_memory_fixes(cfg, local_gpu_count()))
    finally:
        if holder:
            release_run_dir(out)


RDZV_TIMEOUT_ENV = "SHARDTUNE_RDZV_TIMEOUT"


def _check_nodes(args: argparse.Namespace) -> None:
    """The multi-node flags, before anything starts: a node rank out of range or an endpoint that cannot be
    resolved would otherwise wait at the rendezvous for nodes that never come (10 minutes by default)."""
    import socket

    if args.nnodes < 1:
        raise ShardtuneError(f"--nnodes {args.nnodes}: expected a positive integer")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        raise ShardtuneError(f"--node-rank {args.node_rank}: out of range for --nnodes {args.nnodes} (0 to "
                             f"{args.nnodes - 1})")
    timeout = os.environ.get(RDZV_TIMEOUT_ENV, "")
    if timeout and not (timeout.isdigit() and int(timeout) > 0):
        raise ShardtuneError(f"{RDZV_TIMEOUT_ENV}={timeout}: expected a positive number of seconds")
    if args.rdzv_endpoint is None:
        if args.nnodes > 1:
            raise ShardtuneError(f"--nnodes {args.nnodes}: give --rdzv-endpoint HOST:PORT (a host every node reaches; "
                                 "node rank 0's, for example)")
        return
    host, _, port = args.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ShardtuneError(f"--rdzv-endpoint {args.rdzv_endpoint}: expected HOST:PORT, e.g. node01:29500")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port))
    except OSError as err:
        raise ShardtuneError(f"--rdzv-endpoint {args.rdzv_endpoint}: cannot resolve {host} ({err.strerror}); give "
                             "a host name or address every node reaches") from None


def _worker(config: str, overrides: list[str], *, overwrite: bool = False, debug: bool = False) -> int:
    """Body of each torchrun process; ends through clean_exit so gloo cannot abort a finished run."""
    from shardtune import stop

    stop.die_with_parent()  # first: no orphan may outlive a killed launcher
    stop.install()  # before the slow imports, so an early SIGUSR1 does not kill the worker
    from shardtune.config import load_config
    from shardtune.dist import clean_exit

    code = 0
    try:
        from shardtune.train.loop import run_training
        from shardtune.validate import check_worker

        cfg = load_config(config, overrides)
        check_worker(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        code = run_training(cfg, overwrite=overwrite).summary["exit_code"]  # 128 + N: stopped at signal N
    except ShardtuneError as err:
        # Every rank usually hits the same input error. torchrun stops all workers of a node when the first one
        # exits, so the node's other ranks give its first rank time to print the one line and exit first. Each
        # node's first rank says it: another node's log would otherwise show only its launcher's rendezvous error
        # (node 0's agent, which hosts the rendezvous, has gone by then).
        if os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) != "0":
            time.sleep(5)
        if debug:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:  # a Ctrl-C before the loop's handlers were in place: no traceback
        code = 130
    except BaseException as err:
        from shardtune.dist import lost_peer

        if (said := lost_peer(err)) is None or debug:
            traceback.print_exc()
        code = 1
        if said is not None:  # another node (or process) died: a known failure, said in one line
            # Rank 0 waits too: when the dead process was on this node, the launcher saw it and ends this one in
            # that time, with the line that says why (a SIGKILL: the out-of-memory killer) instead of this one.
            # Its monitor looks every 0.1 s, but a loaded machine delayed it past 3 s once and past 10 s once (CI,
            # 2026-12-04: both lines printed). With every process on this node the launcher always sees the death,
            # so the wait ends when it ends this one (its SIGTERM), up to a minute; a remote node's death costs
            # 10-20 s before the line, nothing else. A rank the launcher is already ending stays quiet.
            one_node = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
            wait = 60 if one_node else (20 if os.environ.get("RANK", "0") != "0" else 10)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and not stop.requested():
                time.sleep(0.1)
            if not stop.requested():
                print(f"error: lost a process of the run (another node died or was killed?): {said}; "
                      f"{_newest_checkpoint(config, overrides)}", file=sys.stderr, flush=True)
            code = 2
    clean_exit(code)


def _newest_checkpoint(config: str, overrides: list[str]) -> str:
    """Where a failed run goes on from, as the end of its error line."""
    try:
        from shardtune.checkpoint.layout import checkpoint_root, complete_checkpoints
        from shardtune.config import load_config

        cfg = load_config(config, overrides)
        found = complete_checkpoints(checkpoint_root(cfg.checkpoint, cfg.train.output_dir))
    except Exception:  # only a hint: the error line is what matters
        found = []
    if not found:
        return "no complete checkpoint yet: start again when every node is back"
    return f"the newest complete checkpoint is {found[-1]}: continue with --resume auto when every node is back"


def cmd_validate(args: argparse.Namespace) -> int:
    from shardtune.validate import validate

    validate(args.config, list(args.overrides), nproc_flag=args.nproc, nnodes=args.nnodes,
             hardware=hardware_from(args), force=args.force, overwrite=args.overwrite)
    return 0


EMITS = ("deepspeed", "accelerate", "pytorchjob")


def cmd_plan(args: argparse.Namespace) -> int:
    """`shardtune plan`: the resolved strategy, and the planner's memory and time for every way to run the config
    (config and model checks only; no data, no processes, no GPU needed)."""
    if args.emit == "pytorchjob" and args.config is not None:
        return _emit_pytorchjob(args)  # a launch file: no model to price
    from shardtune.config import load_config
    from shardtune.launch import resolve_nproc
    from shardtune.models.config_json import planning_config

    if args.check is not None:
        from shardtune.plan.report import check_run

        print("\n".join(check_run(args.check)))
        return 0
    if args.config is None:
        raise ShardtuneError("plan: give a config file (shardtune plan CONFIG), or --check RUN_DIR")
    if args.emit is not None and args.emit not in EMITS:
        raise ShardtuneError(f"--emit {args.emit!r}: choose one of {', '.join(EMITS)}")
    if args.nnodes < 1:
        raise ShardtuneError(f"--nnodes {args.nnodes}: expected a positive integer")
    cfg = load_config(args.config, list(args.overrides))
    hf_config = planning_config(cfg.model)  # config.json as JSON where that is enough: no torch import
    world = resolve_nproc(args.nproc, cfg.parallel.nproc)
    from shardtune.plan import auto_keys

    if args.emit is not None or "parallel.strategy" not in auto_keys(cfg):
        from shardtune.validate import check_combination

        # Without --emit, as a planner's candidate: no backend package import (`import deepspeed` is ~5 s).
        check_combination(_concrete(cfg), world, candidate=args.emit is None, nnodes=args.nnodes)
        if args.emit is None and cfg.deepspeed:
            print("note: the deepspeed: section is checked by DeepSpeed's own parser in `shardtune validate` and at "
                  "launch (plan leaves the deepspeed import out)", file=sys.stderr)
    if args.emit is not None:
        if auto_keys(cfg):
            raise ShardtuneError(f"--emit {args.emit}: the config leaves parallel.strategy or train.micro_batch_size "
                                 "to auto; set them (shardtune plan CONFIG shows the pick)")
        if args.emit == "deepspeed":
            _emit_deepspeed(cfg, world)
        else:
            from shardtune.launch import local_gpu_count

            _emit_accelerate(cfg, hf_config, world, cpu=args.gpu is None and local_gpu_count() == 0)
        return 0
    plan = _plan(cfg, hf_config, args, world)
    if args.json:
        import json

        print(json.dumps(plan.to_json(all_candidates=True), indent=2))
        return 0
    from shardtune.plan.report import summary_lines, table

    chosen = _concrete(cfg, plan)
    for key, value in plan_summary(chosen, hf_config, world, args.nnodes):
        print(f"{key:<10} {value}")
    for line in [*summary_lines(plan), "", *table(plan, show_all=args.all)]:
        print(line)
    return 0


def _plan(cfg: Any, hf_config: Any, args: argparse.Namespace, world: int) -> Any:
    from shardtune.plan import make_plan

    hw = hardware_from(args)
    if hw is None:
        from shardtune.plan.hardware import lookup

        print("note: no GPU here and none named: planning for h100 (name one with --gpu)", file=sys.stderr)
        hw = lookup("h100")
    return make_plan(cfg, hf_config, hw, world=world * args.nnodes, per_node=world, all_micro_batches=args.all)


def _concrete(cfg: Any, plan: Any = None) -> Any:
    """The config with auto strategy / micro-batch taken from the plan's pick (or placeholders)."""
    from shardtune.plan import auto_keys, config_for_auto

    auto = auto_keys(cfg)
    if not auto:
        return cfg
    if plan is not None and plan.pick is not None:
        return config_for_auto(cfg, plan.chosen().setting, auto)
    from shardtune.plan.setting import setting_from_config

    return config_for_auto(cfg, setting_from_config(cfg, 1, 1), auto)


def plan_summary(cfg: Any, hf_config: Any, world: int, nnodes: int = 1) -> list[tuple[str, str]]:
    """What a run of this config does on `world` processes per node of `nnodes` nodes, as (item, description)
    rows; the backend describes its engine. (The planner with memory estimates grows here.)"""
    from shardtune.parallel import checkpoint_traced, describe

    p, t = cfg.parallel, cfg.train
    offload = {"none": "none", "optimizer": "optimizer states", "params": "parameters and optimizer states"}[p.offload]
    if p.offload != "none":
        offload += f" to NVMe at {p.offload_nvme_path}" if p.offload_nvme_path else " to CPU memory"
    processes = world * nnodes
    global_batch = t.micro_batch_size * t.grad_accum * processes
    return [
        ("model", f"{hf_config.model_type} ({cfg.model.path or 'preset ' + str(cfg.model.preset)}), "
                  f"decoder block {block_class(hf_config, cfg.model.attn_implementation)}"),
        ("backend", p.backend),
        ("strategy", f"{p.strategy}: {describe(cfg, world, nnodes=nnodes)}"),
        ("offload", offload),
        ("precision", f"{t.precision}" + (f", float8 matmuls ({t.float8})" if t.float8 else "")
                      + f", activation checkpointing {p.activation_checkpointing}"
                      + (", saved activations in host memory" if p.activation_offload else "")
                      + (", compile" if p.compile else "")
                      + (f" ({p.compile_mode})" if p.compile and p.compile_mode != "default" else "")
                      + (f" (Inductor options {p.compile_options})" if p.compile and p.compile_options else "")
                      + (", the checkpoint inside the compiled blocks" if checkpoint_traced(p) else "")
                      + (f", activation memory budget {p.activation_memory_budget:g}"
                         if p.activation_memory_budget is not None else "")),  # the config asks for compile
        ("processes", f"{world} per node" + (f" x {nnodes} nodes" if nnodes > 1 else "")),
        ("batch", f"{global_batch} sequences x {t.seq_len} tokens per step ({t.micro_batch_size} per process x "
                  f"{t.grad_accum} accumulation x {processes} processes)"),
    ]


def block_class(hf_config: Any, attn_implementation: str = "sdpa") -> str:
    """The repeated decoder block's class name (the unit FSDP wraps), from models/facts.py or the model itself."""
    from shardtune.models.facts import ARCH_FACTS, decoder_blocks

    facts = ARCH_FACTS.get(hf_config.model_type)
    if facts is not None:
        return facts.block_class
    from shardtune.models.build import build_on_meta

    return type(decoder_blocks(build_on_meta(hf_config, attn_implementation), hf_config.model_type)[0]).__name__


def _emit_deepspeed(cfg: Any, world: int) -> None:
    import json

    from shardtune.parallel.ds_config import for_trainer

    ds, hint = for_trainer(cfg, world)
    print(json.dumps(ds, indent=2))
    print(hint, file=sys.stderr)


def _emit_accelerate(cfg: Any, hf_config: Any, world: int, *, cpu: bool) -> None:
    import yaml

    from shardtune.parallel.ds_config import for_accelerate

    out, notes = for_accelerate(cfg, world, lambda: block_class(hf_config, cfg.model.attn_implementation), cpu=cpu)
    print(yaml.safe_dump(out, sort_keys=False), end="")
    for note in notes:
        print(note, file=sys.stderr)


def _count(flag: str, text: str | None) -> int:
    """A flag that must be a positive integer, given; one line naming it otherwise."""
    if text is None:
        raise ShardtuneError(f"{flag}: missing; give the number, e.g. {flag} 2")
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ShardtuneError(f"{flag} {text}: expected a positive integer")
    return value


def _cluster_job(args: argparse.Namespace, output_dir: str | None = None) -> Any:
    """The job every node runs, with absolute paths (nodes start elsewhere than the submitting directory)."""
    from shardtune.cluster import Job
    from shardtune.config import load_config

    nodes, gpus = _count("--nodes", args.nodes), _count("--gpus-per-node", args.gpus_per_node)
    cfg = load_config(args.config, list(args.overrides))  # a bad key fails here, not on every node of the job
    out = output_dir or str(Path(getattr(args, "output_dir", None) or cfg.train.output_dir).resolve())
    cache = str(Path(cfg.data.cache_dir).expanduser().resolve()) if cfg.data.cache_dir else None
    return Job(config=str(Path(args.config).resolve()), output_dir=out, nodes=nodes, gpus_per_node=gpus,
               overrides=list(args.overrides), name=f"shardtune-{Path(out).name}".lower(), cache_dir=cache)


def cmd_slurm(args: argparse.Namespace) -> int:
    """`shardtune slurm`: the sbatch script (printed), or written to OUTPUT_DIR/slurm.sbatch and submitted."""
    from shardtune.cluster import sbatch_script

    job = _cluster_job(args)
    script = sbatch_script(job, sys.executable, partition=args.partition, time=args.time, account=args.account,
                           environ=os.environ)
    import shutil

    if args.submit and shutil.which("sbatch") is None:
        raise ShardtuneError("--submit: sbatch not found on PATH; run on a Slurm login node, or drop --submit and "
                             "submit the printed script there")
    try:  # the job's log goes there, and Slurm drops a log whose folder does not exist when the job starts
        Path(job.output_dir).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ShardtuneError(f"--output-dir {job.output_dir}: cannot create it ({err.strerror}); give a folder on "
                             "storage every node sees") from None
    if not args.submit:
        print(script, end="")
        return 0
    import subprocess

    path = Path(job.output_dir) / "slurm.sbatch"
    path.write_text(script)
    proc = subprocess.run(["sbatch", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise ShardtuneError(f"sbatch {path} failed (exit {proc.returncode}): {said}")
    print(f"wrote {path}; {proc.stdout.strip()}")
    return 0


def _emit_pytorchjob(args: argparse.Namespace) -> int:
    import yaml

    from shardtune.cluster import pytorchjob

    if not args.image:
        raise ShardtuneError("--emit pytorchjob: --image missing; give the container image with shardtune installed")
    # Inside the pods the run dir, config and tokenization cache live on the output volume, mounted at /shardtune.
    job = _cluster_job(args)
    job = type(job)(config=f"/shardtune/{Path(args.config).name}", output_dir=f"/shardtune/{Path(job.output_dir).name}",
                    nodes=job.nodes, gpus_per_node=job.gpus_per_node, overrides=job.overrides, name=job.name,
                    cache_dir=None)
    print(yaml.safe_dump(pytorchjob(job, args.image), sort_keys=False), end="")
    print(f"note: copy {args.config} to the volume claim {job.name}-output (ReadWriteMany) as "
          f"{Path(args.config).name}; the run dir is {job.output_dir} there", file=sys.stderr)
    return 0


def cmd_init_model(args: argparse.Namespace) -> int:
    from shardtune.models.init_model import init_model

    path = init_model(Path(args.out_dir), args.preset, config_only=args.config_only, seed=args.seed, dtype=args.dtype)
    print(f"wrote {path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from shardtune.checkpoint.export import export_checkpoint
    from shardtune.config import parse_size
    from shardtune.runtime import young_gc_only

    try:
        max_bytes = parse_size(args.max_shard_size)
    except ValueError as err:
        raise ShardtuneError(f"--max-shard-size: {err}") from None
    with young_gc_only():  # no full GC passes over the imported code
        out = export_checkpoint(args.checkpoint, args.out_dir, dtype=args.dtype, max_shard_bytes=max_bytes,
                                merge_lora=args.merge_lora, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from shardtune.plan.calibrate import calibrate_command

    return calibrate_command(args.out, args.quick, args.gpu)


def cmd_report(args: argparse.Namespace) -> int:
    from shardtune.report import REPORT_DIR, write_report

    dirs = [Path(d) for d in args.run_dirs]
    page = write_report(dirs, Path(args.out) if args.out else dirs[0] / REPORT_DIR)
    print(f"wrote {page}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before or after flags: `train cfg.yaml --nproc 2 train.lr=1e-4`.
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ShardtuneError as err:
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`shardtune plan CFG | head`): stop quietly, as a tool killed by SIGPIPE does;
        # stdout goes to devnull so the interpreter's flush at exit does not raise again (Python's docs, signal).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13


if __name__ == "__main__":
    sys.exit(main())
