"""The package's shape: no import cycles (imports inside functions count too), and each layer imports only
the layers below it: dist knows nothing of the algorithm, the engine's math does not communicate, and only
the application imports the application."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "prunex_hvd"

# what each layer may import from the package (beyond itself)
ALLOWED = {
    "prunex_hvd.dist": (),
    "prunex_hvd.engine": ("prunex_hvd.dist",),
    "prunex_hvd.optimizer": ("prunex_hvd.dist", "prunex_hvd.engine"),
    "prunex_hvd.baselines": ("prunex_hvd.dist", "prunex_hvd.engine", "prunex_hvd.optimizer"),
    "prunex_hvd.app": ("prunex_hvd",),   # the application may use everything
}
# the pure math: tensors in, tensors out, no transport
PURE = ("prunex_hvd.engine.admm", "prunex_hvd.engine.sparsity", "prunex_hvd.engine.buckets",
        "prunex_hvd.engine.dependencies")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str) -> str:
    """The module an import of ``name`` runs last: itself, or (for ``pkg.attr``) the package."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> set:
    """Every package module ``module`` imports explicitly, at any depth of its code."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {_resolve(n) for n in names if n == "prunex_hvd" or n.startswith("prunex_hvd.")}
    found.discard(module)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _inside(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_graph_sees_the_layers():
    # the test reads what it should: the round imports its math and the watchdog, the CLI the trainer
    assert {"prunex_hvd.engine.admm", "prunex_hvd.dist.watchdog"} <= GRAPH["prunex_hvd.engine.hsadmm"]
    assert "prunex_hvd.app.train" in GRAPH["prunex_hvd.app.cli"]   # an import inside a function
    assert "prunex_hvd.engine.sparsity.native" in GRAPH["prunex_hvd.engine.sparsity.packing"]


def test_no_import_cycles():
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(GRAPH[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"
    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("layer", ALLOWED)
def test_layers_import_only_below_them(layer):
    wrong = {}
    for m, deps in GRAPH.items():
        if not _inside(m, layer):
            continue
        bad = [d for d in deps if not _inside(d, layer) and not any(_inside(d, a) for a in ALLOWED[layer])]
        if bad:
            wrong[m] = sorted(bad)
    assert not wrong, f"{layer} reaches above its layer: {wrong}"


def test_the_math_does_not_communicate():
    wrong = {m: sorted(d for d in deps if _inside(d, "prunex_hvd.dist"))
             for m, deps in GRAPH.items() if any(_inside(m, p) for p in PURE)}
    assert not any(wrong.values()), f"pure math importing the transport: {wrong}"


def test_every_folder_is_a_package_that_setup_packs():
    """A folder without ``__init__.py`` imports as a namespace package from a checkout, but ``packages =
    find:`` leaves it out of an installed wheel (it was once git-ignored by a build-output pattern)."""
    from setuptools import find_packages
    folders = {".".join(p.relative_to(ROOT.parent).parts) for p in ROOT.rglob("*.py") for p in [p.parent]}
    assert folders <= set(find_packages(str(ROOT.parent), include=["prunex_hvd", "prunex_hvd.*"]))
