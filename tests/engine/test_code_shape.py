"""The shape of the package (docs/design.md, "Layers"): imports only point down the layers, no
module is over 500 lines and no function over 80. Every import counts, also those inside
functions and under TYPE_CHECKING: a lazy upward import is still an upward dependency."""
from __future__ import annotations

import ast
import os

import sparkserve

ROOT = os.path.dirname(sparkserve.__file__)

# Top to bottom. A module may import its own package and packages of lower rows only.
LAYERS = [
    ("__main__",),
    ("__init__", "cli"),
    ("training",),
    ("entrypoints",),
    ("scheduler",),
    ("speculative", "frontend", "disaggregation"),
    ("executor",),
    ("models",),
    ("loader",),
    ("layers",),
    ("mem", "kernels", "distributed", "constrained"),
    ("args", "messages"),
    ("core",),
    ("config", "sampling_params", "embedded", "dataclass_cli", "addresses", "parallel_config",
     "speculative_args", "priority_args"),
]
RANK = {name: i for i, row in enumerate(LAYERS) for name in row}


def _modules():
    for dirpath, _, files in os.walk(ROOT):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, ROOT), ast.parse(open(path).read(), path)


def _unit(rel: str) -> str:
    """The layer unit of a module path relative to the package: its top folder or module."""
    return rel.split(os.sep)[0].removesuffix(".py")


def _imported_units(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "sparkserve":
                names = [a.name for a in node.names]
            elif node.module.startswith("sparkserve."):
                names = [node.module.split(".")[1]]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names if a.name.startswith("sparkserve.")]
        out += [(node.lineno, n) for n in names]
    return out


def test_every_unit_has_a_layer():
    units = {_unit(rel) for rel, _ in _modules()}
    assert units <= set(RANK), f"add to LAYERS: {sorted(units - set(RANK))}"


def _upward(rel: str, tree: ast.AST) -> list[str]:
    me = _unit(rel)
    return [f"{rel}:{line} imports {target} (layer {RANK[target]}, not below {me}: {RANK[me]})"
            for line, target in _imported_units(tree) if target != me and RANK[target] <= RANK[me]]


def test_imports_point_down():
    bad = [msg for rel, tree in _modules() for msg in _upward(rel, tree)]
    assert not bad, "\n".join(bad)


def test_an_upward_import_is_caught():
    """The walk itself can fail: a lazy scheduler import inside a mem function is reported, a
    same-package one and a downward one are not."""
    tree = ast.parse("import torch\nfrom sparkserve.mem import radix_cache\nfrom sparkserve.core.req import "
                     "Req\n"
                     "def f():\n    from sparkserve.scheduler.scheduler import Scheduler\n")
    assert _upward(os.path.join("mem", "x.py"), tree) == [
        f"{os.path.join('mem', 'x.py')}:5 imports scheduler (layer {RANK['scheduler']}, not below mem: "
        f"{RANK['mem']})"]


def test_no_module_over_500_lines():
    lines = {rel: len(open(os.path.join(ROOT, rel)).readlines()) for rel, _ in _modules()}
    assert not {rel: n for rel, n in lines.items() if n > 500}


def test_no_function_over_80_lines():
    long = [f"{rel}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1}"
            for rel, tree in _modules() for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80]
    assert not long, long
