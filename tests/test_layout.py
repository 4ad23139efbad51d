"""The package's floors, read from the import graph (AST; no third-party tool).

The allowed directions, lowest floor first, are written here and nowhere else (the README's
Layout section describes them):

  io/, kernels/    import nothing of glmtune above them (kernels/ only kernels/, io/ only io/)
  config/          the typed config: io/ only, never distributed/ or a model
  models/common/   kernels/, io/ (a checkpoint's config.json is read as untrusted input)
  models/<family>/ the model code: kernels/, models/common/ and its own family; the family's
                   parallelization plan (`parallelize.py`) may also use distributed/ and config/
  distributed/     mesh, collectives, launchers: no model family, nothing above it
  checkpoint/      HF and DCP checkpoints: builds on the floors below (a family's modules included)
  models/<family>/spec.py, models/registry.py, models/catalog.py   the front door (`ModelSpec`):
                   wires a family's pieces with checkpoint/ and its parallelization plan; the
                   catalog lists the families' torch-free answers (`ModelFamily`, a family's
                   family.py) for `glmtune config validate`
  data/, peft/, generation/   build on the floors below (generation/ reaches a family's
                   decoding hooks, peft/ its LoRA hooks, through the registry: no family's modules)
  train/           never eval/, release/, preflight/
  eval/, release/, plan/, preflight/       the commands' engines
  decide/          `glmtune decide`: eval's machinery and plan's cost
  distill/         `glmtune distill generate`: eval's endpoint client and scorers; its top-K sidecar
                   (distill/topk_store.py, io/ only) sits below train/, whose loss reads it
  cli/             the commands: nothing outside cli/ imports it

train/ and everything above it reach a model family only through the front door (models/common
and the spec floor), never a family's own modules; the Python API (glmtune/__init__.py) re-exports
the family's classes.

The family rule holds all the way down (issue 45): no module outside `models/<family>/` imports
`glmtune.models.<family>` or one of its modules, whatever its floor (checkpoint/, peft/,
generation/, another family): it reaches the family through its spec. Only the front door may:
the family's own `spec.py` (inside its folder), `models/registry.py`, `models/catalog.py` and the
Python API (`glmtune/__init__.py`). `KNOWN_FAMILY` lists the edges not yet moved behind the spec
(the same way: an unlisted one fails, a listed one that is gone fails; the list ends at zero).

and two rules for every module: no two modules import each other, even through others (no
cycle), and no import sits inside a function, except one that keeps `glmtune --help` and
`glmtune config validate` free of torch (the cli/*_cmd.py modules import their engines
lazily), which says so in a comment containing "torch-free" on its line or just above its
block of imports, and then still points down the floors.

`KNOWN_*` list the violations the renovations (issues 29, 45) have not removed yet: a violation
not listed fails, and so does a listed one that is gone (the lists only shrink).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "glmtune"

# floor -> the floors it may import (besides itself). A module's floor is its package
# (models/<family> counted as one; its parallelize.py as its own floor).
_BELOW_TRAIN = {"io", "kernels", "config", "models.common", "models.spec", "distributed", "checkpoint", "data",
                "peft", "generation", "distill.store"}
ALLOWED = {
    "io": set(),
    "kernels": set(),
    "config": {"io"},
    "models.common": {"kernels", "io"},
    "models.family": {"kernels", "models.common"},
    "models.plan": {"kernels", "models.common", "models.family", "distributed", "config", "io"},
    "distributed": {"io", "kernels", "config", "models.common"},
    "checkpoint": {"io", "kernels", "config", "models.common", "models.family", "distributed"},
    "models.spec": {"io", "kernels", "config", "models.common", "models.family", "models.plan", "distributed",
                    "checkpoint"},
    "data": {"io", "config"},
    "peft": {"io", "kernels", "config", "models.common", "models.family", "models.spec", "distributed",
             "checkpoint"},  # a family's LoRA hooks, groups and HF names: its spec
    "generation": {"io", "kernels", "models.common", "models.spec"},  # a family's decoding hooks: its spec
    "train": _BELOW_TRAIN,
    "eval": _BELOW_TRAIN | {"train"},
    "release": _BELOW_TRAIN | {"train", "eval"},
    "plan": _BELOW_TRAIN | {"train"},
    "preflight": _BELOW_TRAIN | {"train", "plan"},
    "decide": _BELOW_TRAIN | {"train", "eval", "plan"},
    "distill.store": {"io"},
    "distill": _BELOW_TRAIN | {"train", "eval"},  # `glmtune distill generate`: eval's endpoint client and scorers
    "cli": _BELOW_TRAIN | {"train", "eval", "release", "plan", "preflight", "decide", "root", "distill"},
    "root": _BELOW_TRAIN | {"models.family"},  # glmtune/__init__.py: the Python API
    "api": _BELOW_TRAIN | {"train", "eval"},  # glmtune/api.py: load a recipe, train, evaluate (docs/python-api.md)
}

# Violations not yet removed: (importing module, imported module) for floors and cycles,
# (module, imported module) for imports inside functions.
KNOWN_FLOOR: set[tuple[str, str]] = set()
KNOWN_CYCLE: set[frozenset[str]] = set()
KNOWN_IN_FUNCTION: set[tuple[str, str]] = set()
DECLARED_LAZY: set[tuple[str, str]] = set()  # filled by import_graph()
# Family imports from outside the family (issue 45): (importing module, the family's module);
# moved behind the spec one by one, until none is left.
KNOWN_FAMILY: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    if parts[1] == "models":
        if len(parts) > 2 and parts[2] == "common":
            return "models.common"
        if parts[-1] == "parallelize":
            return "models.plan"
        return "models.spec" if parts[-1] in ("spec", "registry", "catalog") else "models.family"
    if parts[1] == "__main__":
        return "cli"
    if parts[1:] == ["distill", "topk_store"]:
        return "distill.store"  # the top-K sidecar: written by distill/, read by the training loss
    return parts[1]


def _target(node: ast.ImportFrom | ast.Import, alias: ast.alias, module: str, is_package: bool) -> str | None:
    if isinstance(node, ast.Import):
        name = alias.name
    else:
        base = node.module or ""
        if node.level:  # relative import
            parts = module.split(".")
            keep = len(parts) - node.level + (1 if is_package else 0)
            base = ".".join(parts[:keep] + ([base] if base else []))
        name = f"{base}.{alias.name}" if base else alias.name
    return name if name.split(".")[0] == "glmtune" else None


def _declared_torch_free(lines: list[str], lineno: int) -> bool:
    """A "torch-free" comment on the import's line, or just above its block of imports."""
    first = lineno - 1
    while first > 0 and lines[first - 1].strip().startswith(("from ", "import ")):
        first -= 1
    return any("#" in line and "torch-free" in line.split("#", 1)[1] for line in lines[max(0, first - 1):lineno])


def import_graph() -> tuple[dict[str, set[str]], set[tuple[str, str]], set[str]]:
    """(module -> modules it imports, (module, target) pairs inside functions, every module);
    in-function imports declared torch-free are in `DECLARED_LAZY` afterwards."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    in_function: set[tuple[str, str]] = set()
    DECLARED_LAZY.clear()
    for module, path in modules.items():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        tree = ast.parse(text)
        nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for alias in node.names:
                target = _target(node, alias, module, path.name == "__init__.py")
                if target is None:
                    continue
                while target not in modules and "." in target:  # `from pkg import name`: the module is pkg
                    target = target.rsplit(".", 1)[0]
                if target == module or target not in modules:
                    continue
                edges[module].add(target)
                if id(node) in nested:
                    in_function.add((module, target))
                    if _declared_torch_free(lines, node.lineno):
                        DECLARED_LAZY.add((module, target))
    return edges, in_function, set(modules)


def _cycles(edges: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], set(), [0]
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.add(frozenset(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


FRONT_DOOR = {"glmtune", "glmtune.models.registry", "glmtune.models.catalog"}  # besides models/<family>/spec.py


def family_of(module: str) -> str | None:
    """The family whose folder holds `module` (glmtune.models.<family>[.x]); None outside one."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "models" or parts[2] in ("common", "registry", "catalog"):
        return None
    return parts[2]


def family_violations(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports of a family's module from outside the family's folder, the front door aside."""
    return {(a, b) for a, targets in edges.items() for b in targets
            if family_of(b) is not None and family_of(a) != family_of(b) and a not in FRONT_DOOR}


def floor_violations(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in edges.items() for b in targets
            if floor(a) != floor(b) and floor(b) not in ALLOWED[floor(a)]}


def function_import_violations(edges, in_function, declared=frozenset()) -> set[tuple[str, str]]:
    """In-function imports not declared torch-free (`declared`: (module, target) pairs that are)."""
    return {(a, b) for a, b in in_function if (a, b) not in declared}


def test_every_floor_is_listed():
    _, _, modules = import_graph()
    assert {floor(m) for m in modules} <= set(ALLOWED)


def test_imports_point_down_the_floors():
    found = floor_violations(import_graph()[0])
    assert found - KNOWN_FLOOR == set(), "imports against the floors (see this file's docstring)"
    assert KNOWN_FLOOR - found == set(), "fixed: remove them from KNOWN_FLOOR"


def test_no_module_outside_a_family_imports_it():
    found = family_violations(import_graph()[0])
    assert found - KNOWN_FAMILY == set(), "a family's modules imported from outside it: go through its spec"
    assert KNOWN_FAMILY - found == set(), "fixed: remove them from KNOWN_FAMILY"


def test_no_import_cycles():
    found = _cycles(import_graph()[0])
    assert found - KNOWN_CYCLE == set(), "modules that import each other"
    assert KNOWN_CYCLE - found == set(), "fixed: remove them from KNOWN_CYCLE"


def test_no_imports_inside_functions():
    edges, in_function, _ = import_graph()
    found = function_import_violations(edges, in_function, frozenset(DECLARED_LAZY))
    assert found - KNOWN_IN_FUNCTION == set(), "imports inside functions (only cli/*_cmd.py may, for --help)"
    assert KNOWN_IN_FUNCTION - found == set(), "fixed: remove them from KNOWN_IN_FUNCTION"


def test_the_rules_catch_what_they_forbid():
    edges = {"glmtune.kernels.x": {"glmtune.models.glm5.moe"}, "glmtune.models.glm5.moe": {"glmtune.kernels.x"},
             "glmtune.distributed.mesh": {"glmtune.models.glm5.args"}, "glmtune.config.validate": {
                 "glmtune.distributed.mesh"}, "glmtune.train.run": {"glmtune.eval.suite"},
             "glmtune.eval.models": {"glmtune.cli.arg_types"}, "glmtune.models.glm5.parallelize": {
                 "glmtune.distributed.mesh"}}
    assert floor_violations(edges) == {
        ("glmtune.kernels.x", "glmtune.models.glm5.moe"), ("glmtune.distributed.mesh", "glmtune.models.glm5.args"),
        ("glmtune.config.validate", "glmtune.distributed.mesh"), ("glmtune.train.run", "glmtune.eval.suite"),
        ("glmtune.eval.models", "glmtune.cli.arg_types")}
    assert _cycles(edges) == {frozenset({"glmtune.kernels.x", "glmtune.models.glm5.moe"})}
    assert family_violations(edges | {
        "glmtune.models.registry": {"glmtune.models.glm5.spec"}, "glmtune": {"glmtune.models.glm5.model"},
        "glmtune.models.glm5.spec": {"glmtune.models.glm5.model"}, "glmtune.models.hf.spec": {
            "glmtune.models.glm5.args"}, "glmtune.generation.generator": {"glmtune.models.common.rope"}}) == {
        ("glmtune.kernels.x", "glmtune.models.glm5.moe"), ("glmtune.distributed.mesh", "glmtune.models.glm5.args"),
        ("glmtune.models.hf.spec", "glmtune.models.glm5.args")}
    assert function_import_violations(edges, {("glmtune.cli.train_cmd", "glmtune.train.run"),
                                              ("glmtune.train.run", "glmtune.data.prepare")},
                                      frozenset({("glmtune.cli.train_cmd", "glmtune.train.run")})) == {
        ("glmtune.train.run", "glmtune.data.prepare")}
    lines = ["def f():", "    # the engine imports torch: lazily, so --help stays torch-free",
             "    from glmtune.train import run", "    from glmtune.data import prepare", "    x = 1",
             "    from glmtune.eval import suite"]
    assert _declared_torch_free(lines, 3) and _declared_torch_free(lines, 4) and not _declared_torch_free(lines, 6)


# Functions over MAX_FUNCTION_LINES allowed by name: a Triton kernel is one GPU program (its
# body cannot be split into Python calls); `KNOWN_LONG` shrinks to nothing.
MAX_FUNCTION_LINES = 100
LONG_BY_NATURE: dict[str, str] = {}
KNOWN_LONG: set[str] = set()


def long_functions() -> dict[str, int]:
    """module.function -> its length in lines, for every function over MAX_FUNCTION_LINES that
    is not a Triton kernel."""
    found = {}
    for path in ROOT.rglob("*.py"):
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = node.end_lineno - node.lineno + 1
            triton = any("triton" in ast.unparse(d) for d in node.decorator_list)
            if length > MAX_FUNCTION_LINES and not triton:
                found[f"{module}.{node.name}"] = length
    return found


def test_no_function_is_longer_than_a_screen_or_two():
    found = long_functions()
    unexpected = {name: n for name, n in found.items() if name not in LONG_BY_NATURE and name not in KNOWN_LONG}
    assert unexpected == {}, f"functions over {MAX_FUNCTION_LINES} lines: split them"
    assert KNOWN_LONG - set(found) == set(), "fixed: remove them from KNOWN_LONG"


# A private name (one leading underscore) is its module's own business, and its package's: no
# module imports one from another package of glmtune (`from glmtune.checkpoint.hf_io import _open`
# in peft/); a package that needs another's step asks for a public name with a docstring (eval's
# steps that `glmtune decide` shares are public in eval/evaluate.py). A package is the folder
# holding the module (a package's __init__ is its own). `KNOWN_PRIVATE` lists the imports not yet
# made public: (importing module, imported module, name); it only shrinks.
KNOWN_PRIVATE: set[tuple[str, str, str]] = set()


def package_of(module: str, modules: set[str]) -> str:
    """The package holding `module`: itself for a package's __init__, else its parent."""
    return module if any(m.startswith(module + ".") for m in modules) else module.rsplit(".", 1)[0]


def private_imports() -> set[tuple[str, str, str]]:
    """(importing module, imported module, name) for every `from glmtune.X import _name`, the
    name private (one leading underscore, not a dunder), whatever the floor."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    found = set()
    for module, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            for alias in node.names:
                if not alias.name.startswith("_") or alias.name.startswith("__"):
                    continue
                target = _target(node, alias, module, path.name == "__init__.py")
                if target is None:
                    continue
                target = target.rsplit(".", 1)[0]  # `from pkg.mod import _name`: the module is pkg.mod
                if target in paths:
                    found.add((module, target, alias.name))
    return found


def cross_package_private(found: set[tuple[str, str, str]], modules: set[str]) -> set[tuple[str, str, str]]:
    return {(a, b, name) for a, b, name in found if package_of(a, modules) != package_of(b, modules)}


def test_no_module_imports_a_private_name_of_another_package():
    _, _, modules = import_graph()
    found = cross_package_private(private_imports(), modules)
    assert found - KNOWN_PRIVATE == set(), "private names imported across packages: make them public (docstring)"
    assert KNOWN_PRIVATE - found == set(), "fixed: remove them from KNOWN_PRIVATE"


def test_the_private_import_rule_catches_what_it_forbids():
    modules = {"glmtune.cli", "glmtune.cli.eval_cmd", "glmtune.cli.decide_cmd", "glmtune.eval", "glmtune.eval.evaluate",
               "glmtune.eval.scorers", "glmtune.eval.scorers.facts", "glmtune.decide", "glmtune.decide.run"}
    assert cross_package_private({("glmtune.decide.run", "glmtune.eval.evaluate", "_scorecard"),
                                  ("glmtune.eval.evaluate", "glmtune.eval.scorers.facts", "_normalize"),
                                  ("glmtune.cli.decide_cmd", "glmtune.cli.eval_cmd", "_launch"),
                                  ("glmtune.cli.eval_cmd", "glmtune.cli", "_debug")}, modules) == {
        ("glmtune.decide.run", "glmtune.eval.evaluate", "_scorecard"),
        ("glmtune.eval.evaluate", "glmtune.eval.scorers.facts", "_normalize")}
