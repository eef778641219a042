"""The package layout keeps its shape (ARCHITECTURE.md): imports point one way, down LAYERS; no package
imports another's private names; and only the backends (and config parsing) ask which backend or strategy a
run has. Read from the sources with ast, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "shardtune"

# Top to bottom; a package may import its own modules and those of packages in lower layers only.
LAYERS: list[set[str]] = [
    {""},  # shardtune/__init__.py: the Python API
    {"api", "__main__"},
    {"cli"},
    {"validate"},
    {"train"},
    {"plan", "report"},  # report: reads a run's files and plots them; train writes one at the end
    {"checkpoint"},
    {"parallel"},
    {"assemble"},
    {"peft"},
    {"models"},
    {"data"},
    {"config"},
    {"cluster"},  # launch files for clusters (text only)
    {"dist", "fileio", "metrics", "launch", "runtime"},
    {"workerstart"},  # the forkserver worker start (tests' CPU launches): launch starts it, dist's exit reports to it
    {"errors"},  # exception types and error_chain, stdlib only: dist and fileio read wrapped errors with it
    {"stop"},  # signal flags and handlers, stdlib only: launch (the launcher's side) imports it
    {"redact"},  # secrets masked in what a run saves or shows, stdlib only: config, trackers, report, train use it
]
# Known exceptions, each with its reason.
UPWARD_ALLOWED = {
    # The preset table is data that imports nothing; config checks a preset's name at load, so a typo stops
    # with the key's one-line error like every other config error.
    ("config", "shardtune.models.presets"),
    # The train package shares its name with the public API function: once imported it hides the function on the
    # shardtune package, so calling the package dispatches (lazily) to api.train (train/__init__.py).
    ("train", "shardtune.api"),
    # A worker forked from the forkserver runs the command line as `python -m shardtune ARGS` would: the entry
    # point it calls, where a Popen'd worker names it on its command line.
    ("workerstart", "shardtune.cli"),
}
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _package(module: str) -> str:
    """shardtune.a.b -> a (the top-level package or module inside shardtune)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _sources() -> list[tuple[Path, str, ast.Module]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out.append((path, parts[0] if parts else "", ast.parse(path.read_text(), str(path))))
    return out


def _imports(tree: ast.Module) -> list[tuple[int, str, list[str]]]:
    """(line, imported shardtune module, names) of every import, also inside functions and TYPE_CHECKING."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                (node.module == "shardtune" or node.module.startswith("shardtune.")):
            names = [a.name for a in node.names]
            if node.module == "shardtune":  # `from shardtune import peft`: each name is a package
                found += [(node.lineno, f"shardtune.{n}", []) for n in names]
            else:
                found.append((node.lineno, node.module, names))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("shardtune.")]
    return found


def test_every_package_has_a_layer():
    packages = {pkg for _, pkg, _ in _sources()}
    assert packages <= set(RANK), packages - set(RANK)


def test_imports_point_down_the_layers():
    upward = []
    for path, pkg, tree in _sources():
        for line, module, _ in _imports(tree):
            target = _package(module)
            if target == pkg or (pkg, module) in UPWARD_ALLOWED:
                continue
            if target not in RANK or RANK[target] <= RANK[pkg]:
                upward.append(f"{path.relative_to(SRC)}:{line}: {pkg} imports {module}")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_package_imports_another_packages_private_names():
    private = []
    for path, pkg, tree in _sources():
        for line, module, names in _imports(tree):
            if _package(module) == pkg:
                continue
            bad = [n for n in names if n.startswith("_")] + [p for p in module.split(".") if p.startswith("_")]
            if bad:
                private.append(f"{path.relative_to(SRC)}:{line}: {module} {bad}")
    assert not private, "private names imported across packages:\n" + "\n".join(private)


# Where a backend or strategy name may be compared: the backends themselves and config parsing. The planner's
# memory and time model (plan/) prices each strategy by name (zero2 gathers once, zero3 twice: generic ZeRO
# facts), but never asks which backend it prices: what differs between backends is in plan/backends.py, one
# class per backend, reached through Setting.rules.
NAME_CHECKS_ALLOWED = ("parallel/", "config.py", "plan/")
BACKEND_CHECKS_ALLOWED = ("parallel/", "config.py")
_KEYS = {"backend", "strategy"}


def _names_a_key(node: ast.AST, keys: set[str] = _KEYS) -> bool:
    """cfg.parallel.backend, p.strategy, x["strategy"], x.get("backend", ...)"""
    if isinstance(node, ast.Attribute):
        return node.attr in keys
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value in keys
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value in keys
    return False


def _is_name_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_name_literal(e) for e in node.elts)
    return False


def name_checks(tree: ast.Module, keys: set[str] = _KEYS) -> list[int]:
    """Lines comparing a backend or strategy (`keys`) with a name (==, !=, in, not in)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_a_key(s, keys) for s in sides) and any(_is_name_literal(s) for s in sides):
                lines.append(node.lineno)
    return sorted(lines)


def test_the_name_check_finder_finds_them():
    tree = ast.parse('if cfg.parallel.backend == "deepspeed" or p.strategy in ("ddp", "zero1"): pass\n'
                     'x = run.get("parallel", {}).get("strategy") != "ddp"\ny = cfg.parallel.backend == other\n')
    assert name_checks(tree) == [1, 1, 2]


def test_only_the_backends_ask_which_backend_or_strategy_a_run_has():
    found = []
    for path, _, tree in _sources():
        rel = path.relative_to(SRC).as_posix()
        if not rel.startswith(NAME_CHECKS_ALLOWED):
            found += [f"{rel}:{line}" for line in name_checks(tree)]
    assert not found, "backend / strategy checks outside parallel/ (move them into the backend's spec):\n" + \
        "\n".join(found)


def test_only_the_backends_ask_which_backend_a_run_has():
    """DESIGN.md: no `backend == "..."` outside parallel/ (the planner too: plan/backends.py dispatches by class)."""
    found = []
    for path, _, tree in _sources():
        rel = path.relative_to(SRC).as_posix()
        if not rel.startswith(BACKEND_CHECKS_ALLOWED):
            found += [f"{rel}:{line}" for line in name_checks(tree, {"backend"})]
    assert not found, "backend checks outside parallel/:\n" + "\n".join(found)
