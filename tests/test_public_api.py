"""The package's shape: what notebooks import is public, modules import no private names from each other,
module-level imports form no cycle, and no module grows past the size a reader can hold."""

import ast
import json
import re
from pathlib import Path

import pytest

import cgutils as cg

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cgutils"
MODULES = sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool):
    """``(imported module, [names])`` for every ``from ... import`` in the file, relative ones resolved."""
    tree = ast.parse(path.read_text())
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            yield target, [a.name for a in node.names]


def test_every_name_a_notebook_imports_is_public():
    """Notebooks imported ~27 names from submodules that cgutils.__all__ did not list: the API in real use
    was wider than the public one."""
    modules = {_module_name(p).split(".")[-1] for p in MODULES}
    missing = []
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            for m in re.finditer(r"from cgutils[\w.]* import ([\w, ]+)", "".join(cell["source"])):
                for name in (n.strip() for n in m.group(1).split(",")):
                    if name not in cg.__all__ and name not in modules:
                        missing.append(f"{nb.name}: {name}")
    assert not missing, missing


def test_no_module_imports_a_private_name_from_another():
    """diagnose, bench and the tests reached into other modules' private helpers, so moving one broke them."""
    found = [f"{p.relative_to(ROOT)}: {target}.{name}" for p in MODULES + sorted((ROOT / "tests").glob("*.py"))
             for target, names in _imports(p, top_level_only=False) for name in names
             if target.startswith("cgutils") and name.startswith("_") and name != "__version__"]
    assert not found, found


def test_module_level_imports_form_no_cycle():
    graph = {_module_name(p): {t for t, _ in _imports(p, top_level_only=True) if t.startswith("cgutils")}
             for p in MODULES}
    # a package's __init__ re-exporting its children is not a cycle of behaviour
    graph = {m: {t for t in deps if not m.startswith(t + ".") and t != m} for m, deps in graph.items()}

    def visit(node, stack):
        if node in stack:
            pytest.fail("import cycle: " + " -> ".join([*stack[stack.index(node):], node]))
        for nxt in graph.get(node, ()):
            visit(nxt, [*stack, node])

    for module in graph:
        visit(module, [])


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_small(path):
    """capture.py had grown to 1,186 lines (GraphRunner alone ~420) doing capture, validation, argument
    checks and padding; each module now holds one job."""
    assert len(path.read_text().splitlines()) <= 500


OLD_PATHS = {  # module paths users may have imported before the layout step (issue 22), with a name of each
    "cgutils.pitfall_cases": ["Pitfall", "run_entry", "through_runner", "observed_row", "manual_capture"],
    "cgutils.pitfall_cases_real_use": ["run_in_threads", "threads_check", "raw_capture", "STEPS", "LENGTHS"],
    "cgutils.pitfalls_real_use": ["REAL_USE", "NormalizeInPlace", "DecodeStep", "Sampler"],
    "cgutils.generation_stop": ["StopTokenDecoder", "hf_generate_until_eos", "LOOPS"],
    "cgutils.generation_tp": ["TensorParallelKVState", "tp_generate"],
    "cgutils.distributed": ["agree_across_ranks", "warm_up_collectives", "rank_and_world", "ColumnParallelLinear",
                            "RowParallelLinear"],
    "cgutils.generation": ["GreedyDecoder", "StaticKVState", "hf_generate", "BATCH_BUCKETS", "check_prompt"],
    "cgutils.pitfalls": ["PITFALLS", "run", "catalogue_table", "markdown_table", "Scaled", "DropoutNet", "KINDS"],
}


@pytest.mark.parametrize("path", OLD_PATHS)
def test_moved_module_paths_still_import(path):
    """Moving the pitfall and generation modules into packages must not break `from cgutils.<old> import X`."""
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module(path)
        for name in OLD_PATHS[path]:
            assert getattr(module, name) is not None, f"{path}.{name}"
        with pytest.raises(AttributeError, match="no attribute 'nope'"):
            module.nope  # noqa: B018


def test_the_top_level_stays_readable_and_the_runner_lean():
    """Issue 22: 23 flat modules and a 348-line GraphRunner; now at most 16 modules beside the packages, one
    concept per package, and the coordinator at most 250 lines."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 16, top
    assert {"pitfalls", "generation", "capture", "bench"} <= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    tree = ast.parse((PACKAGE / "capture" / "runner.py").read_text())
    runner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GraphRunner")
    assert runner.end_lineno - runner.lineno + 1 <= 250
