"""The shape of the package, checked: no import cycles, the layer rules of DESIGN.md, small files
and short functions. Every import counts, also those inside functions.

Units and what each may import (besides itself and the standard library / third parties):

- ``config`` (pure data), ``timing``, ``rundir``, ``metrics`` (the metric table and the metrics'
  computations), ``moved`` (old module names and their new places): nothing of vitflow;
- ``runtime`` (allocator, device, precision, seeding): ``timing``;
- ``models``: the foundation (``config``, ``runtime``, ``timing``) and ``rundir`` (a run folder's
  names: ``model.pretrained=RUN``); no other layer;
- ``data``: ``config``, ``runtime``, ``timing``; no ``models`` / ``training`` / ``infer``;
- ``checkpoint`` (files, ``model_from_checkpoint``): ``models``, ``rundir``;
- ``evaluation`` (a model over batches): ``data``, ``runtime``, ``metrics``;
- ``training``: every layer to its left and the shared services;
- ``infer``: the same but ``training``;
- ``viz``: ``infer`` and what it may import, ``rundir``; no ``training``;
- ``quality`` (``vitflow inspect``: what a dataset holds): as ``viz``; it never trains (the API's
  k-fold path trains and hands it the probabilities);
- ``api`` (the Python face, ``vitflow.train`` / ``load`` / ``Config`` / ``Run``): every layer but ``cli``;
- the package (``vitflow/__init__.py``): ``models``, ``moved``, and ``api`` for the API's names;
- ``cli``: everything.

At most :data:`MAX_PACKAGE_MODULES` modules at any package level (sub-packages are rooms named for what
they hold), outside :data:`CROWDED_PACKAGES`.

Inside ``models``: the family packages (``vit``, ``eva``, ``swin``, ...: every sub-package but the
shared ones, :data:`MODEL_SHARED`) never import each other, and the attention math (softmax,
``scaled_dot_product_attention``) lives only in ``models/attention`` and ``models/kernels``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vitflow

SRC = Path(vitflow.__file__).parent
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300
MAX_PACKAGE_MODULES = 12  # modules directly in one package (its __init__.py and sub-packages not counted)
# packages allowed more modules than that, each with its reason
CROWDED_PACKAGES: dict[str, str] = {
    "vitflow.data.sources": "one module per kind of data, each one row of the kinds' table (sources/table.py)",
}
MODEL_SHARED = {"attention", "kernels", "convert", "pretrained"}  # sub-packages of models every family may use
ATTENTION_HOMES = ("attention", "kernels")  # where the attention math may live, inside models
ATTENTION_MATH = ("softmax", "scaled_dot_product_attention")  # calls that are attention math

FOUNDATION = {"config", "runtime", "timing"}
ALLOWED: dict[str, set[str]] = {
    "config": set(), "timing": set(), "rundir": set(), "metrics": set(), "moved": set(),
    "runtime": {"timing"},
    "models": FOUNDATION | {"rundir"},  # rundir: the names of a run folder (a run as pretrained weights)
    "data": {"config", "runtime", "timing"},
    "checkpoint": {"models", "rundir"},
    "evaluation": {"data", "runtime", "metrics"},
    "training": FOUNDATION | {"models", "data", "checkpoint", "evaluation", "metrics", "rundir"},
    "infer": FOUNDATION | {"models", "data", "checkpoint", "evaluation", "metrics"},
    "viz": FOUNDATION | {"models", "data", "checkpoint", "evaluation", "metrics", "infer", "rundir"},
    "quality": FOUNDATION | {"models", "data", "checkpoint", "evaluation", "metrics", "infer", "rundir"},
    "package": {"models", "moved", "api"},  # vitflow/__init__.py: create_model and friends, the API's names
}
ALLOWED["api"] = {u for u in ALLOWED if u not in ("api", "package")} | {"viz"}  # the Python face: all but the CLI
# functions allowed over MAX_FUNCTION_LINES, each with its reason
LONG_FUNCTIONS: dict[str, str] = {}


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def import_graph(root: Path) -> dict[str, set[str]]:
    """``module -> the package's modules it imports`` (at any depth in the file)."""
    mods = modules(root)
    package = root.name
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets: set[str] = set()
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.split(".")[0] == package)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if base.split(".")[0] != package:
                    continue
                for a in node.names:  # `from pkg.x import y`: y may be a module
                    targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def unit(module: str) -> str:
    parts = module.split(".")
    return "package" if len(parts) == 1 else ("cli" if parts[1] == "__main__" else parts[1])


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """``"a -> b"`` for every import whose unit may not import the other's (see the module docstring)."""
    bad = []
    for src, targets in sorted(graph.items()):
        u = unit(src)
        for dst in sorted(targets):
            v = unit(dst)
            if u != "cli" and v != u and v not in ALLOWED.get(u, set()):
                bad.append(f"{src} -> {dst} ({u} may not import {v})")
    return bad


def long_files(root: Path, limit: int = MAX_FILE_LINES) -> list[str]:
    return [f"{p.relative_to(root.parent)}: {n} lines" for p in sorted(root.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > limit]


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES, allowed: dict[str, str] | None = None) -> list[str]:
    """``module.function: N lines`` for every function (or method) longer than ``limit``,
    docstring included, outside ``allowed``."""
    allowed = LONG_FUNCTIONS if allowed is None else allowed
    out = []
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                key = f"{name}.{node.name}"
                if n > limit and key not in allowed:
                    out.append(f"{key}: {n} lines")
    return out


def long_classes(root: Path, limit: int = MAX_CLASS_LINES) -> list[str]:
    """``module.Class: N lines`` for every class longer than ``limit``."""
    return [f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines" for name, path in modules(root).items()
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit]


def crowded_packages(root: Path, limit: int = MAX_PACKAGE_MODULES, allowed: dict[str, str] | None = None
                     ) -> list[str]:
    """``package: N modules`` for every package holding more than ``limit`` modules directly
    (``__init__.py`` and sub-packages not counted), outside ``allowed``."""
    allowed = CROWDED_PACKAGES if allowed is None else allowed
    out = []
    for init in sorted(root.rglob("__init__.py")):
        name = module_name(init, root)
        n = sum(1 for p in init.parent.glob("*.py") if p.name != "__init__.py")
        if n > limit and name not in allowed:
            out.append(f"{name}: {n} modules")
    return out


def model_family(module: str) -> str | None:
    """The family package a module of ``models`` belongs to (``vitflow.models.swin.block`` -> ``swin``),
    or ``None`` for the shared modules and packages."""
    parts = module.split(".")
    if len(parts) < 4 or parts[1] != "models" or parts[2] in MODEL_SHARED:
        return None
    return parts[2]


def family_crossings(graph: dict[str, set[str]]) -> list[str]:
    """``"a -> b"`` for every import from one model family's package into another's."""
    return [f"{src} -> {dst}" for src, targets in sorted(graph.items()) for dst in sorted(targets)
            if model_family(src) and model_family(dst) and model_family(src) != model_family(dst)]


def stray_attention_math(root: Path) -> list[str]:
    """``module: call`` for every attention-math call (:data:`ATTENTION_MATH`) in ``models`` outside
    :data:`ATTENTION_HOMES`."""
    out = []
    for name, path in modules(root).items():
        parts = name.split(".")
        if len(parts) < 3 or parts[1] != "models" or parts[2] in ATTENTION_HOMES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called in ATTENTION_MATH:
                    out.append(f"{name}: {called} (line {node.lineno})")
    return out


def test_no_import_cycles():
    assert cycles(import_graph(SRC)) == []


def test_layers_import_only_what_the_rules_allow():
    assert layer_violations(import_graph(SRC)) == []


def test_config_imports_no_other_part_of_vitflow():
    graph = import_graph(SRC)
    assert {t for m, ts in graph.items() if unit(m) == "config" for t in ts if unit(t) != "config"} == set()


def test_no_source_file_over_400_lines():
    assert long_files(SRC) == []


def test_no_function_over_60_lines():
    assert long_functions(SRC) == []


def test_no_class_over_300_lines():
    assert long_classes(SRC) == []


def test_no_package_level_over_12_modules():
    assert crowded_packages(SRC) == []
    counts = {name: sum(1 for p in (SRC / name).glob("*.py") if p.name != "__init__.py")
              for name in ("training", "infer")}
    assert all(0 < n <= MAX_PACKAGE_MODULES for n in counts.values()), counts


def test_train_is_a_function_and_training_a_plain_package():
    """``vitflow.train`` is the Python API's function; the training layer is an ordinary package
    (no module subclass, nothing callable), and an old import names the new place in one line."""
    import inspect
    import types

    import vitflow.training
    from vitflow.api.run import train

    assert inspect.isfunction(vitflow.train) and vitflow.train is train
    assert type(vitflow.training) is types.ModuleType and not callable(vitflow.training)
    assert vitflow.training.Trainer.__module__ == "vitflow.training.loop"
    for old in ("import vitflow.train", "from vitflow.train import Trainer", "from vitflow.train.loop import Trainer"):
        with pytest.raises(ModuleNotFoundError, match=r"^vitflow\.train is now the Python API's training function.*"
                                                      r"moved to vitflow\.training \("):
            exec(old, {})
    with pytest.raises(ModuleNotFoundError, match=r"^vitflow\.infer\.onnx_model moved to vitflow\.infer\.runtimes\.onnx$"):
        exec("from vitflow.infer.onnx_model import OnnxModel", {})
    with pytest.raises(ModuleNotFoundError, match="No module named 'vitflow.not_a_module'"):
        exec("import vitflow.not_a_module", {})


def test_every_moved_module_names_a_module_that_exists():
    import importlib.util

    from vitflow.moved import MOVED

    assert {new for new in MOVED.values() if importlib.util.find_spec(new) is None} == set()
    old_paths = [SRC.parent / old.replace(".", "/") for old in MOVED]
    assert [p for p in old_paths if p.with_suffix(".py").exists() or p.is_dir()] == []  # no old name still exists


def test_the_trainer_reads_as_a_loop():
    """Side concerns are callbacks and set-up functions: the Trainer class stays at most 200 lines."""
    tree = ast.parse((SRC / "training" / "loop.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    assert trainer.end_lineno - trainer.lineno + 1 <= 200


def test_model_families_do_not_import_each_other():
    graph = import_graph(SRC)
    assert {model_family(m) for m in graph} >= {"vit", "eva", "swin"}  # the check sees the families
    assert family_crossings(graph) == []


def test_attention_math_lives_in_attention_and_kernels():
    assert stray_attention_math(SRC) == []


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def bad_package(tmp_path: Path) -> Path:
    """A package named vitflow with one of each violation."""
    root = tmp_path / "vitflow"
    for pkg in ("", "models/", "training/", "data/"):
        _write(root, f"{pkg}__init__.py", "")
    _write(root, "data/a.py", "from vitflow.data import b\n")  # a cycle: a -> b -> a
    _write(root, "data/b.py", "def f():\n    from vitflow.data.a import x\n")  # (a lazy import counts too)
    _write(root, "training/loop.py", "import vitflow.models\n")  # allowed
    _write(root, "data/big.py", "x = 1\n" * 401)
    _write(root, "data/long.py", "def h():\n" + "    y = 1\n" * 60)
    for pkg in ("models/vit/", "models/swin/", "models/attention/"):
        _write(root, f"{pkg}__init__.py", "")
    _write(root, "models/swin/block.py", "from vitflow.models.vit import model\n")  # a family importing another
    _write(root, "models/vit/model.py", "def g():\n    from vitflow.training import loop\n    return x.softmax(-1)\n")  # models -> training
    _write(root, "models/attention/core.py", "def a(s):\n    return s.softmax(-1)\n")  # its home: allowed
    _write(root, "data/big_class.py", "class C:\n" + "    y = 1\n" * 300)
    for i in range(12):  # data/ now holds 13 modules
        _write(root, f"data/m{i}.py", "")
    return root


def test_the_checks_catch_each_kind_of_violation(bad_package):
    graph = import_graph(bad_package)
    assert cycles(graph) == [["vitflow.data.a", "vitflow.data.b"]]
    assert layer_violations(graph) == ["vitflow.models.vit.model -> vitflow.training.loop (models may not import training)"]
    assert long_files(bad_package) == ["vitflow/data/big.py: 401 lines"]
    assert long_functions(bad_package, allowed={}) == ["vitflow.data.long.h: 61 lines"]
    assert long_functions(bad_package, allowed={"vitflow.data.long.h": "a reason"}) == []
    assert long_classes(bad_package) == ["vitflow.data.big_class.C: 301 lines"]
    assert crowded_packages(bad_package) == ["vitflow.data: 17 modules"]
    assert crowded_packages(bad_package, allowed={"vitflow.data": "a reason"}) == []
    assert family_crossings(graph) == ["vitflow.models.swin.block -> vitflow.models.vit.model"]
    assert stray_attention_math(bad_package) == ["vitflow.models.vit.model: softmax (line 3)"]
