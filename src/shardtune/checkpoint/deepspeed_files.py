"""DeepSpeed-format checkpoints (the deepspeed backend's `STEP/deepspeed/state/`): the format (DeepSpeedFormat:
the engine writes and reads its own files), a pickle check before anything reads them, and a streaming reader
of the consolidated fp32 model for `shardtune export`.

The layout, spelled here only: STEP/NATIVE_DIR is the folder the engine saves into, with one DeepSpeed tag
(TAG) per shardtune checkpoint, so its files lie in STEP/STATE_DIR.

check_pickles
    DeepSpeed loads its .pt files with torch.load(weights_only=False): a planted pickle runs code at
    resume. Every *.pt is scanned statically first (torch.serialization.get_unsafe_globals_in_checkpoint
    reads the pickle opcodes of data.pkl, never the tensor data) and refused when it names any global
    beyond torch's weights_only allow-list and the few DeepSpeed classes of ALLOWED_GLOBALS.

weights_only_loads
    a context for DeepSpeed's own resume (engine.load_checkpoint): its reads become
    torch.load(weights_only=True) with the same allow-list, so even a pickle the scan could not judge
    cannot run code.

deepspeed_model_tensors
    name -> LazyTensor (shape, dtype, load()) of the model a checkpoint holds, in module order, with
    the fp32 master weights assembled from every rank's optimizer partition one tensor at a time.
    Files are opened with torch.load(mmap=True, weights_only=True): a tensor's bytes are read from
    disk only when load() asks for them, and no DeepSpeed code runs (stand-in classes take the place
    of the four DeepSpeed classes while unpickling), so export needs no DeepSpeed install.

Why not DeepSpeed's own `zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True)`
(deepspeed 0.19.8): its lazy mode is lazy for ZeRO-3 only (GatheredTensor over mmap'd partitions).
For ZeRO-1/2 it torch.cat's every rank's partition of each group into one full fp32 vector first
("memory usage doubles here"), i.e. the whole model in host memory; it loads the model-state files
whole (no mmap) with weights_only=False; it has no stage 0 (the weights are in
mp_rank_00_model_states.pt, the fp32 masters of a bf16/fp16 run in its 'optimizer' entry); and it
prints progress to stdout. The layout logic here follows it (and tests compare against it).

Layouts read (deepspeed 0.19; file names `[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`):
  stage 0    mp_rank_00_model_states.pt: 'module' (weights; fp32 in an fp32 run) and 'optimizer' (the
             client optimizer's state; for bf16/fp16 DeepSpeed's FP16 optimizer wrapper with the fp32
             masters per param group in 'fp32_groups', or flattened in 'fp32_groups_flat')
  stage 1/2  mp_rank_00_model_states.pt: 'param_shapes' per group, buffers, 'shared_params'; per rank
             'single_partition_of_fp32_groups' (that rank's contiguous slice of each group's flat
             vector) and 'param_slice_mappings' (name -> numel/start of the param's fragment in it)
  stage 3    per rank zero_pp_rank_R_mp_rank_00_model_states.pt (param_shapes, buffers) and
             'fp32_flat_groups': every param split into world equal chunks (the last one padded),
             rank R holding chunk R of each param, params in param_shapes order
Frozen parameters are not read: shardtune's backend saves with exclude_frozen_parameters for LoRA
(the base is re-read from model.path / the preset), and a full fine-tuning run has none.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardtune.checkpoint.formats import LazyTensor, Written
from shardtune.checkpoint.layout import finalize, record_own
from shardtune.errors import ShardtuneError

if TYPE_CHECKING:
    from shardtune.config import CheckpointConfig
    from shardtune.dist import DistContext

NATIVE_DIR = "deepspeed"  # under a step directory: where the engine saves (format "deepspeed" in the manifest)
TAG = "state"  # one DeepSpeed tag per shardtune checkpoint directory
STATE_DIR = Path(NATIVE_DIR) / TAG  # the engine's files, under a step directory


class DeepSpeedFormat:
    """The deepspeed backend's engine files (`backend.save_native` / `load_native`): DeepSpeed's partitioned
    optimizer state does not reshard on load, and the engine writes synchronously."""

    name = "deepspeed"
    reshardable = False
    asynchronous = False

    def start(self, cfg: CheckpointConfig, ctx: DistContext, root: Path) -> None:
        self.is_main = ctx.is_main
        self.warn_async = cfg.async_save and ctx.is_main  # at the first save

    def write(self, backend: Any, tmp: Path, final: Path, info: dict[str, Any]) -> Written:
        if self.warn_async:
            print("warning: checkpoint.async is ignored by the deepspeed backend; checkpoints are written "
                  "synchronously", flush=True)
            self.warn_async = False
        backend.save_native(tmp / NATIVE_DIR, TAG)  # collective: one model and one optimizer file per rank
        # Each rank checksums the files it wrote (DeepSpeed names them zero_pp_rank_R_...), on its own node, so
        # rank 0 reads only its own and the engine's shared files (model states below stage 3, `latest`).
        rank = dist.get_rank() if dist.is_initialized() else 0
        record_own(tmp, sorted(p for p in (tmp / STATE_DIR).glob(f"*zero_pp_rank_{rank}_*") if p.is_file()), rank,
                   "deepspeed")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        if self.is_main:
            finalize(tmp, final, info)
        return Written()

    def read(self, backend: Any, path: Path) -> None:
        # Nothing in a checkpoint may run code: DeepSpeed unpickles with weights_only=False, so the
        # pickles are scanned first and then read with weights_only=True and an allow-list.
        check_pickles(path / STATE_DIR)
        with weights_only_loads(backend.engine):
            backend.load_native(path / NATIVE_DIR, TAG)

    def resume_on(self, path: Path, saved_world: int, world: int) -> None:
        if saved_world != world:
            raise ShardtuneError(f"checkpoint {path} is a DeepSpeed checkpoint of {saved_world} processes; DeepSpeed "
                                 f"resumes on the same number only: use --nproc {saved_world} (or the fsdp2 backend, "
                                 "whose checkpoints reshard to any count)")

    def tensors(self, path: Path) -> dict[str, LazyTensor]:
        return deepspeed_model_tensors(path)

    def close(self) -> None:
        pass

# Globals real DeepSpeed checkpoints pickle beyond torch's own weights_only allow-list (tensors,
# storages, dtypes, OrderedDict, ...). Found by scanning checkpoints of stages 0/1/2/3 x fp32/bf16/fp16
# x full/LoRA, with and without optimizer/param offload (deepspeed 0.19.8, tests/dist/deepspeed_ckpt_worker.py).
# As DeepSpeed pickles them, each is only constructed: a class through NEWOBJ (object.__new__, no
# __init__) + BUILD (no __setstate__ in its MRO: a plain __dict__ update), the enum through REDUCE
# (a lookup by value); none of them runs code of its own. A hostile pickle could still use them in
# other ways under DeepSpeed's full unpickler (e.g. BUILD onto the class object: setattr of data or
# of another allowed global), but it can only call what the scan lets through; the full check is
# weights_only_loads below, whose unpickler refuses all of that.
ALLOWED_GLOBALS: dict[str, str] = {
    # ZeRO optimizers' state_dict()['loss_scaler']: the static scaler of fp32/bf16 runs (attributes
    # cur_scale, dynamic), stages 1-3.
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "static loss scaler (fp32/bf16, ZeRO-1/2/3)",
    # ... and the dynamic one of fp16 runs (cur_scale, cur_iter, scale_window, hysteresis counters, dtype).
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": "dynamic loss scaler (fp16, ZeRO-1/2/3)",
    # state_dict()['zero_stage'] of every ZeRO optimizer: an int Enum (ZeroStageEnum(2) by value).
    "deepspeed.runtime.zero.config.ZeroStageEnum": "ZeRO stage enum (ZeRO-1/2/3)",
    # ZeRO-1/2 'param_slice_mappings': name -> fragment_address(numel, start), a two-int dataclass.
    "deepspeed.utils.tensor_fragment.fragment_address": "param fragment numel/start (ZeRO-1/2)",
}


def check_pickles(folder: Path) -> None:
    """Refuse (ShardtuneError, one line) a DeepSpeed checkpoint folder whose .pt pickles name anything
    but torch's weights_only globals and ALLOWED_GLOBALS, or that cannot be checked. Reads only the
    pickles (data.pkl of each file), never the tensor data; runs nothing from them."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ShardtuneError(f"{folder}: no DeepSpeed checkpoint folder there")
    files = sorted(folder.rglob("*.pt"))
    if not files:
        raise ShardtuneError(f"{folder}: no DeepSpeed checkpoint files (*.pt) there")
    with _torch_registered_globals_only():
        for f in files:
            if not f.is_file():
                raise ShardtuneError(f"{f}: not a regular file; refusing to load the checkpoint")
            try:
                found = torch.serialization.get_unsafe_globals_in_checkpoint(f)
            except Exception as err:  # not a zip torch.save file, torchscript, or opcodes the scanner cannot follow
                reason = " ".join(str(err).split()) or type(err).__name__
                raise ShardtuneError(f"{f}: cannot be checked for code it would run ({reason}); "
                                     "refusing to load it") from None
            bad = sorted(g for g in found if g not in ALLOWED_GLOBALS)
            if bad:
                more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                raise ShardtuneError(f"{f}: the pickle refers to {bad[0]}{more}, which no DeepSpeed checkpoint holds "
                                     "and which could run code when loaded; refusing to load it")


@contextmanager
def _torch_registered_globals_only() -> Iterator[None]:
    """get_unsafe_globals_in_checkpoint treats whatever anyone add_safe_globals()'d as safe; while
    scanning, keep only what torch itself registered (any other library's additions are checked)."""
    ser = torch.serialization
    registered = ser.get_safe_globals()
    keep = [g for g in registered if _global_module(g).split(".")[0] == "torch"]
    if len(keep) == len(registered):
        yield
        return
    ser.clear_safe_globals()
    ser.add_safe_globals(keep)
    try:
        yield
    finally:
        ser.clear_safe_globals()
        ser.add_safe_globals(registered)


@contextmanager
def weights_only_loads(engine: Any) -> Iterator[None]:
    """While DeepSpeed reads a checkpoint (`engine.load_checkpoint(...)` inside this block), its checkpoint
    engine unpickles with torch.load(weights_only=True), allowing torch's own globals and the real
    DeepSpeed classes of ALLOWED_GLOBALS only, instead of weights_only=False: a second wall behind
    check_pickles (which only sees the pickle's GLOBAL opcodes, not what the unpickler does with them).
    DeepSpeed 0.19 reads every file of a non-universal checkpoint through `engine.checkpoint_engine.load`."""
    import importlib

    allowed = []
    for name in ALLOWED_GLOBALS:
        module, attr = name.rsplit(".", 1)
        allowed.append(getattr(importlib.import_module(module), attr))
    reader = engine.checkpoint_engine
    own = vars(reader).get("load")

    def load(path: str, map_location: Any = None) -> Any:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)

    reader.load = load
    try:
        yield
    finally:
        if own is None:
            del reader.load
        else:
            reader.load = own


def _global_module(entry: Any) -> str:
    if isinstance(entry, tuple):
        return str(entry[1])
    return str(getattr(entry, "__module__", "") or "")


# ---- reading with weights_only: stand-ins for the DeepSpeed classes ------------------------------------------

class _Record:
    """Takes the place of a DeepSpeed class while unpickling: holds the pickled attributes, runs nothing."""


class _LossScaler(_Record):
    pass


class _DynamicLossScaler(_Record):
    pass


class _FragmentAddress(_Record):
    numel: int
    start: int


class _ZeroStage(int):
    pass


_STAND_INS: list[tuple[Any, str]] = [
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]
assert {name for _, name in _STAND_INS} == set(ALLOWED_GLOBALS)


def load_file(path: Path) -> dict[str, Any]:
    """One DeepSpeed .pt file: memory-mapped (tensor bytes are read when used), weights_only (only torch's
    allow-list and the stand-ins above can be built)."""
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:
        reason = " ".join(str(err).split())[:300] or type(err).__name__
        raise ShardtuneError(f"{path}: cannot read it as a DeepSpeed checkpoint file ({reason})") from None
    if not isinstance(obj, dict):
        raise ShardtuneError(f"{path}: not a DeepSpeed checkpoint file (holds a {type(obj).__name__})")
    return obj


# ---- the model in a checkpoint, tensor by tensor -----------------------------------------------------------------

_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_RANK_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


def deepspeed_model_tensors(step_dir: Path) -> dict[str, LazyTensor]:
    """Parameter (and persistent buffer) name -> LazyTensor of the model in a shardtune step directory
    written by the deepspeed backend; parameters as the fp32 master weights. For a LoRA run: the
    adapter tensors (frozen base weights are not in the checkpoint). Checks the pickles first."""
    folder = Path(step_dir) / STATE_DIR
    check_pickles(folder)
    names = sorted(p.name for p in folder.glob("*.pt"))
    optim = _by_rank(folder, names, _OPTIM)
    rank_models = _by_rank(folder, names, _RANK_MODEL)
    models = [n for n in names if _MODEL.match(n)]
    unknown = [n for n in names if not (_OPTIM.match(n) or _RANK_MODEL.match(n) or _MODEL.match(n))]
    if unknown or any(_MODEL.match(n).group(1) != "00" for n in models):  # type: ignore[union-attr]
        odd = unknown[0] if unknown else next(n for n in models if not n.startswith("mp_rank_00_"))
        raise ShardtuneError(f"{folder}: unexpected file {odd} (pipeline, tensor or expert parallel DeepSpeed "
                             "checkpoints are not read by shardtune)")
    if not optim:
        if models != ["mp_rank_00_model_states.pt"]:
            raise ShardtuneError(f"{folder}: neither ZeRO optimizer files nor mp_rank_00_model_states.pt; "
                                 "not a complete DeepSpeed checkpoint")
        return _stage0(folder / models[0])
    optim_states = [_optimizer_state(p) for p in optim]
    stage = int(optim_states[0].get("zero_stage", -1))
    _check_world(folder, optim_states, len(optim))
    if stage in (1, 2):
        if models != ["mp_rank_00_model_states.pt"]:
            raise ShardtuneError(f"{folder}: a ZeRO-{stage} checkpoint without mp_rank_00_model_states.pt")
        return _stage12(folder, load_file(folder / models[0]), optim_states)
    if stage == 3:
        if len(rank_models) != len(optim):
            raise ShardtuneError(f"{folder}: {len(optim)} optimizer files but {len(rank_models)} model-state "
                                 "files; a rank's files are missing")
        return _stage3(folder, load_file(rank_models[0]), optim_states)
    raise ShardtuneError(f"{folder}: unknown ZeRO stage {stage!r} in {optim[0].name}")


def _optimizer_state(path: Path) -> dict[str, Any]:
    state = load_file(path).get("optimizer_state_dict")
    if not isinstance(state, dict):
        raise ShardtuneError(f"{path}: no optimizer_state_dict; not a ZeRO optimizer file")
    return state


def _by_rank(folder: Path, names: list[str], pattern: re.Pattern[str]) -> list[Path]:
    found = {}
    for n in names:
        m = pattern.match(n)
        if m:
            if m.group(2) != "00":
                raise ShardtuneError(f"{folder}: unexpected file {n} (tensor-parallel DeepSpeed checkpoints are not "
                                     "read by shardtune)")
            found[int(m.group(1))] = folder / n
    if sorted(found) != list(range(len(found))):
        missing = min(set(range(max(found) + 1)) - set(found))
        raise ShardtuneError(f"{folder}: the files of rank {missing} are missing; not a complete DeepSpeed "
                             "checkpoint")
    return [found[r] for r in range(len(found))]


def _check_world(folder: Path, optim_states: list[dict[str, Any]], files: int) -> None:
    counts = optim_states[0].get("partition_count")
    world = max(counts) if isinstance(counts, list) else counts
    if world != files:
        raise ShardtuneError(f"{folder}: written by {world} ranks but {files} optimizer files are there")


def _module_order(module: dict[str, Any], names: Sequence[str]) -> list[str]:
    """`names` in the module's state-dict order (the order transformers writes), the rest after."""
    wanted = set(names)
    ordered = [k for k in module if k in wanted]
    return ordered + [k for k in names if k not in set(ordered)]


def _buffers(model_state: dict[str, Any]) -> dict[str, LazyTensor]:
    module = model_state.get("module") or {}
    out = {}
    for name in model_state.get("buffer_names") or []:
        if name in module and torch.is_tensor(module[name]):
            t = module[name]
            out[name] = LazyTensor(tuple(t.shape), t.dtype, _copy_of(t))
    return out


def _copy_of(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t.clone()


def _with_shared(tensors: dict[str, LazyTensor], model_state: dict[str, Any]) -> dict[str, LazyTensor]:
    """DeepSpeed records a tied parameter once, its other names in 'shared_params' (alias -> name)."""
    for alias, source in (model_state.get("shared_params") or {}).items():
        if source in tensors and alias not in tensors:
            tensors[alias] = tensors[source]
    return tensors


def _param_shapes(model_state: dict[str, Any], folder: Path) -> list[dict[str, tuple[int, ...]]]:
    groups = model_state.get("param_shapes")
    if not isinstance(groups, list):
        raise ShardtuneError(f"{folder}: the model states hold no param_shapes; not a ZeRO checkpoint")
    return [{name: tuple(int(d) for d in shape) for name, shape in group.items()} for group in groups]


def _stage12(folder: Path, model_state: dict[str, Any], optim_states: list[dict[str, Any]]) -> dict[str, LazyTensor]:
    """ZeRO-1/2: each group's flat fp32 vector is cut into one contiguous slice per rank; a parameter's
    fragments are named in every rank's param_slice_mappings (numel and start within that rank's slice)."""
    shapes = _param_shapes(model_state, folder)
    partitions = [o["single_partition_of_fp32_groups"] for o in optim_states]
    mappings = [o.get("param_slice_mappings") for o in optim_states]
    if any(m is None or len(m) != len(shapes) for m in mappings) or any(len(p) != len(shapes) for p in partitions):
        raise ShardtuneError(f"{folder}: the optimizer files' groups do not match the model's param_shapes "
                             "(a DeepSpeed older than 0.6, or a damaged checkpoint)")
    tensors: dict[str, LazyTensor] = {}
    for g, group in enumerate(shapes):
        for name, shape in group.items():
            pieces = []
            for rank in range(len(optim_states)):
                address = mappings[rank][g].get(name)
                if address is not None and int(address.numel) > 0:
                    pieces.append((partitions[rank][g], int(address.start), int(address.numel)))
            if sum(n for _, _, n in pieces) != math.prod(shape):
                raise ShardtuneError(f"{folder}: the optimizer partitions hold {sum(n for _, _, n in pieces)} values "
                                     f"of {name} (shape {list(shape)}); a damaged checkpoint")
            tensors[name] = LazyTensor(shape, torch.float32, _gather_fragments(pieces, shape))
    tensors.update(_buffers(model_state))
    module = model_state.get("module") or {}
    return _with_shared({k: tensors[k] for k in _module_order(module, list(tensors))}, model_state)


def _gather_fragments(pieces: list[tuple[torch.Tensor, int, int]],
                      shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        return torch.cat([flat.narrow(0, start, n) for flat, start, n in pieces]).float().view(shape)

    return load


def _stage3(folder: Path, model_state: dict[str, Any], optim_states: list[dict[str, Any]]) -> dict[str, LazyTensor]:
    """ZeRO-3: every parameter is split into `world` chunks of ceil(numel / world) (the last padded);
    rank R's fp32_flat_groups hold chunk R of each parameter, in param_shapes order."""
    world = len(optim_states)
    shapes = {name: shape for group in _param_shapes(model_state, folder) for name, shape in group.items()}
    flats = [_Flat(o["fp32_flat_groups"]) for o in optim_states]
    tensors: dict[str, LazyTensor] = {}
    offset = 0
    for name, shape in shapes.items():
        chunk = -(-math.prod(shape) // world)
        tensors[name] = LazyTensor(shape, torch.float32, _gather_chunks(flats, offset, chunk, shape))
        offset += chunk
    if any(flat.numel != offset for flat in flats):
        raise ShardtuneError(f"{folder}: the optimizer partitions hold {flats[0].numel} values per rank, the "
                             f"parameters need {offset}; a damaged checkpoint")
    tensors.update(_buffers(model_state))
    module = model_state.get("module") or {}
    return _with_shared({k: tensors[k] for k in _module_order(module, list(tensors))}, model_state)


class _Flat:
    """A rank's fp32 groups as one virtual flat vector (a slice may cross a group boundary)."""

    def __init__(self, groups: list[torch.Tensor]) -> None:
        self.groups = list(groups)
        self.starts = [0]
        for t in self.groups:
            self.starts.append(self.starts[-1] + t.numel())
        self.numel = self.starts[-1]

    def slice(self, start: int, n: int) -> list[torch.Tensor]:
        out = []
        for t, lo, hi in zip(self.groups, self.starts, self.starts[1:], strict=False):
            a, b = max(start, lo), min(start + n, hi)
            if a < b:
                out.append(t.narrow(0, a - lo, b - a))
        return out


def _gather_chunks(flats: list[_Flat], offset: int, chunk: int, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        parts = [piece for flat in flats for piece in flat.slice(offset, chunk)]
        return torch.cat(parts).narrow(0, 0, math.prod(shape)).float().view(shape)

    return load


def _stage0(path: Path) -> dict[str, LazyTensor]:
    """ZeRO-0 (DeepSpeed's data parallelism): one file with the module's weights; in a bf16/fp16 run the
    fp32 masters sit in the FP16 optimizer wrapper's groups, which carry no names: they are matched to
    the trainable parameters the way the backend grouped them (train/optim.py param_groups: >= 2-D
    tensors, then the rest, each in module order, empty groups dropped), and each master is checked to
    round to exactly the module's weight when read."""
    from shardtune.peft.lora import is_adapter

    state = load_file(path)
    module = state.get("module")
    optimizer = state.get("optimizer")
    if not isinstance(module, dict) or not isinstance(optimizer, dict):
        raise ShardtuneError(f"{path}: no module weights or optimizer state; not a complete DeepSpeed checkpoint")
    buffers = _buffers(state)
    first: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    params: list[str] = []
    aliases: dict[str, str] = {}
    for name, t in module.items():
        if name in buffers or not torch.is_tensor(t):
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key in first and t.numel():
            aliases[name] = first[key]  # a tied weight: the same storage under a second name
        else:
            first[key] = name
            params.append(name)
    if any(is_adapter(n) for n in params):
        # LoRA: the adapters are trained; a frozen base tensor DeepSpeed still wrote (a tied LM head is not
        # caught by exclude_frozen_parameters) is not part of the adapter.
        params = [n for n in params if is_adapter(n)]
        aliases = {a: s for a, s in aliases.items() if s in params}
    inner = optimizer.get("optimizer_state_dict", optimizer)
    n_opt = sum(len(g.get("params", ())) for g in inner.get("param_groups", ()))
    if n_opt != len(params):
        raise ShardtuneError(f"{path}: the optimizer holds {n_opt} parameters, the module {len(params)} trainable "
                             "ones; cannot tell which weights were trained")
    groups = [g for g in ([n for n in params if module[n].dim() >= 2], [n for n in params if module[n].dim() < 2])
              if g]
    tensors: dict[str, LazyTensor] = {}
    if "fp32_groups" in optimizer or "fp32_groups_flat" in optimizer:
        masters = _stage0_masters(path, optimizer, groups, module)
        for name in params:
            tensors[name] = LazyTensor(tuple(module[name].shape), torch.float32,
                                       _checked_master(path, name, masters[name], module[name]))
    else:  # fp32: the module's weights are the ones the optimizer steps
        for name in params:
            t = module[name]
            tensors[name] = LazyTensor(tuple(t.shape), t.dtype, _copy_of(t))
    tensors.update(buffers)
    for alias, source in aliases.items():
        tensors[alias] = tensors[source]
    return {k: tensors[k] for k in _module_order(module, list(tensors))}


def _stage0_masters(path: Path, optimizer: dict[str, Any], groups: list[list[str]],
                    module: dict[str, Any]) -> dict[str, Callable[[], torch.Tensor]]:
    flat = "fp32_groups_flat" in optimizer
    saved = optimizer["fp32_groups_flat" if flat else "fp32_groups"]
    if len(saved) != len(groups):
        raise ShardtuneError(f"{path}: {len(saved)} fp32 master groups, {len(groups)} parameter groups expected")
    out: dict[str, Callable[[], torch.Tensor]] = {}
    for masters, names in zip(saved, groups, strict=True):
        if flat:
            if masters.numel() != sum(module[n].numel() for n in names):
                raise ShardtuneError(f"{path}: an fp32 master group does not match the module's parameters")
            offset = 0
            for n in names:
                out[n] = _flat_slice(masters, offset, tuple(module[n].shape))
                offset += module[n].numel()
        else:
            if len(masters) != len(names) or any(tuple(m.shape) != tuple(module[n].shape)
                                                 for m, n in zip(masters, names, strict=False)):
                raise ShardtuneError(f"{path}: the fp32 master weights do not line up with the module's parameters")
            for m, n in zip(masters, names, strict=True):
                out[n] = _copy_of(m)
    return out


def _flat_slice(flat: torch.Tensor, offset: int, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    return lambda: flat.narrow(0, offset, math.prod(shape)).clone().view(shape)


def _checked_master(path: Path, name: str, master: Callable[[], torch.Tensor],
                    weight: torch.Tensor) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        t = master().float()
        if not torch.equal(t.to(weight.dtype), weight):
            raise ShardtuneError(f"{path}: the fp32 master weight matched to {name} does not round to its "
                                 f"{weight.dtype} weight; cannot tell which master belongs to it")
        return t

    return load
