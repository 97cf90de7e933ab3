"""mpcomm's modules import downward only, and no two modules import each other (also through a chain).

Every module under ``mpcomm/`` is parsed with ``ast`` — imports inside functions included, since a cycle hidden
inside a function is still a cycle; imports under ``if TYPE_CHECKING:`` are left out (they name types for the
checker and never run) — and each import of another mpcomm module is
checked against the layer order below (the same list is in ``docs/dispatch.md``). A module may import its own layer
or any layer below; importing a layer above, or any cycle between modules, fails with the modules named.

    python -m pytest -q tests/test_layers.py          (serial; reads the source only)
"""
from __future__ import annotations

import ast
import os

import pytest

import mpcomm

ROOT = os.path.dirname(mpcomm.__file__)

# Bottom to top. A module's layer is that of the longest name listed that is it or a package holding it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("facts", ("mpcomm.errors", "mpcomm.info", "mpcomm.mpi_library", "mpcomm.cuda", "mpcomm.buffers",
               "mpcomm.kernels", "mpcomm.work_array", "mpcomm.native_calls", "mpcomm.compression", "mpcomm.tuning.table",
               "mpcomm.schedules")),
    ("transports", ("mpcomm.transport", "mpcomm.topology", "mpcomm.settings", "mpcomm.work", "mpcomm.p2p",
                    "mpcomm.device", "mpcomm.staging", "mpcomm.trace")),
    ("algorithms", ("mpcomm.algorithms",)),
    ("dispatch", ("mpcomm.plan", "mpcomm.dispatch", "mpcomm.tuning")),
    ("communicator", ("mpcomm.comm", "mpcomm.mesh")),
    ("engines", ("mpcomm.nn", "mpcomm.parallel", "mpcomm.workload")),
    ("entry points", ("mpcomm", "mpcomm.integrations", "mpcomm.bench", "mpcomm.train", "mpcomm.launch",
                      "mpcomm.tuning.cli", "mpcomm.tuning.__main__", "mpcomm.trace.__main__")),
]


def module_names() -> dict[str, str]:
    """Every module's dotted name -> its file."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = ["mpcomm", *os.path.relpath(path, ROOT)[:-3].split(os.sep)]
                if parts[-1] == "__init__":
                    parts.pop()
                found[".".join(parts)] = path
    return found


def imports(module: str, path: str, known: set[str]) -> set[str]:
    """The mpcomm modules ``module`` imports anywhere in its file (a package's own submodules as themselves)."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):  # type-only imports: dropped before the walk below
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            node.body = []
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                whole = f"{base}.{alias.name}"
                out.add(whole if whole in known else base)  # a submodule imported by name, else the module
    return {name for name in out if name in known and name != module}


def layer_of(module: str) -> int:
    best, level = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), index
    assert level is not None, f"{module} is in no layer: add it to LAYERS (and docs/dispatch.md)"
    return level


def graph() -> dict[str, set[str]]:
    names = module_names()
    return {module: imports(module, path, set(names)) for module, path in names.items()}


def test_every_import_points_down_or_sideways():
    upward = [f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
              for module, targets in sorted(graph().items()) for target in sorted(targets)
              if layer_of(target) > layer_of(module)]
    assert not upward, "upward imports:\n  " + "\n  ".join(upward)


def test_no_import_cycles():
    edges = graph()
    cycles, state, stack = [], {}, []

    def visit(module: str) -> None:  # depth-first; a back edge closes a cycle
        state[module] = "open"
        stack.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


@pytest.mark.parametrize("module, expected", [("mpcomm.algorithms.ring", "algorithms"), ("mpcomm.comm", "communicator"),
                                              ("mpcomm.tuning.table", "facts"), ("mpcomm", "entry points")])
def test_layer_lookup_takes_the_longest_name(module, expected):
    assert LAYERS[layer_of(module)][0] == expected
