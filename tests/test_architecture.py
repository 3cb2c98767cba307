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
        "prunex_hvd.engine.dependencies", "prunex_hvd.engine.state", "prunex_hvd.engine.codec", "prunex_hvd.engine.rho")


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


# -- the engine's components: one concern per file, the transport in the exchange alone ------------------------
ENGINE = ROOT / "engine"
COLLECTIVES = {"allreduce_", "allreduce_async_", "broadcast_", "allgather", "leaders_then_node_",
               "racks_then_down_", "barrier"}
TRANSPORT = {"prunex_hvd.engine.exchange", "prunex_hvd.engine.racks"}   # every collective the engine issues
FACADE_LINES, COMPONENT_LINES = 250, 400


def _engine_modules():
    return {m: p for m, p in MODULES.items() if _inside(m, "prunex_hvd.engine")}


def test_every_engine_file_opens_with_what_it_holds_and_stays_short():
    sizes = {m: len(p.read_text().splitlines()) for m, p in _engine_modules().items()}
    assert sizes["prunex_hvd.engine.hsadmm"] <= FACADE_LINES, "the round's facade grew: move a concern out"
    assert not {m: n for m, n in sizes.items() if n > COMPONENT_LINES}
    undocumented = [m for m, p in _engine_modules().items() if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not undocumented


def test_only_the_exchange_issues_collectives():
    calls = {}
    for m, p in _engine_modules().items():
        if m in TRANSPORT:
            continue
        found = sorted({n.func.attr for n in ast.walk(ast.parse(p.read_text()))
                        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in COLLECTIVES})
        if found:
            calls[m] = found
    assert not calls, f"collectives outside the exchange: {calls}"
    # and the test sees them where they are
    assert any(isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "leaders_then_node_"
               for n in ast.walk(ast.parse(MODULES["prunex_hvd.engine.exchange"].read_text())))


def test_components_do_not_reach_back_into_the_facade():
    wrong = {m: "prunex_hvd.engine.hsadmm" for m in _engine_modules()
             if m != "prunex_hvd.engine.hsadmm" and "prunex_hvd.engine.hsadmm" in GRAPH[m]}
    assert not wrong
    # the round's phases are calls into the components, each imported by the facade
    assert {f"prunex_hvd.engine.{c}" for c in ("state", "exchange", "racks", "codec", "masks", "verdict", "rho",
                                               "steps", "overlap", "report")} <= GRAPH["prunex_hvd.engine.hsadmm"]
