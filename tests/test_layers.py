"""The package's layers: no import cycle inside fedcore, the core reaches the plug-in packages only
through the registry, and setup.cfg's import-linter contracts hold (when lint-imports is installed)."""
import ast
import configparser
import re
import shutil
import subprocess
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ("fedcore.handlers", "fedcore.algorithms", "fedcore.scenarios")


def package_dirs() -> dict[str, Path]:
    """fedcore and the plug-in packages mapped into it, as setup.cfg's package_dir installs them."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    mapped = dict(line.split("=") for line in cfg["options"]["package_dir"].strip().splitlines())
    return {"fedcore": ROOT / "fedcore", **{k.strip(): ROOT / v.strip() for k, v in mapped.items()}}


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Every module's dotted name -> its file (a package's name -> its __init__.py)."""
    out = {}
    for name, folder in packages.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if any(p != name and f"{name}.{parts[0]}" == p for p in packages):
                continue  # a link to a mapped package inside fedcore/ (a development checkout's)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((name, *parts))] = path
    return out


def imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules `module` imports anywhere in its file: at module level and in functions."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                head = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*head, base] if base else head)
            # `from p import name`: the module p.name where it is one, else p itself
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:   # `import a.b.c` of a name inside a module
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph(packages: dict[str, Path]) -> nx.DiGraph:
    known = modules(packages)
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for module, path in known.items():
        graph.add_edges_from((module, target) for target in imported(module, path, known))
    return graph


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    return [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]


def test_the_graph_sees_a_cycle_closed_inside_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (pkg / "c.py").write_text("import pkg.a as a\n")
    graph = import_graph({"pkg": pkg})
    assert set(graph.edges) == {("pkg.a", "pkg.sub.b"), ("pkg.sub.b", "pkg.c"), ("pkg.c", "pkg.a")}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_no_import_cycle_inside_fedcore():
    graph = import_graph(package_dirs())
    assert len(graph) > 100 and "fedcore.runtime.course" in graph and "fedcore.handlers.sync" in graph
    assert ("fedcore.runtime.course", "fedcore.kernel.registry") in graph.edges
    found = cycles(graph)
    assert found == [], "import cycles: " + "; ".join(
        " -> ".join(edge[0] for edge in nx.find_cycle(graph.subgraph(c))) for c in found)


def test_the_core_reaches_the_plug_in_packages_only_through_the_registry():
    graph = import_graph(package_dirs())
    reaching = sorted((m, t) for m, t in graph.edges
                      if not m.startswith(PLUGINS) and t.startswith(PLUGINS))
    assert reaching == []


def test_the_import_linter_contracts_hold():
    if shutil.which("lint-imports") is None:
        pytest.skip("import-linter is not installed (the dev extra has it)")
    run = subprocess.run([str(ROOT / ".ci" / "lint-layers")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    kept = re.search(r"Contracts: (\d+) kept, 0 broken", run.stdout)
    assert kept and int(kept.group(1)) >= 3, run.stdout   # setup.cfg's contracts were all read


def test_the_old_flat_module_names_import_the_moved_modules():
    """Code written against the flat layout gets the same module objects (`python -m` with an
    old name: tests/test_moved.py; `python -m fedcore.kernel.key_index --check` in a fresh
    process: tests/test_key_index.py)."""
    import importlib

    import fedcore
    import fedcore.runtime.course
    from fedcore.runtime import course
    assert fedcore.runtime.course is course and course.__name__ == "fedcore.runtime.course"
    from fedcore.execution import vectorized
    assert vectorized is importlib.import_module("fedcore.execution.vectorized")
    assert importlib.import_module("fedcore.kernel.registry") is importlib.import_module("fedcore.kernel.registry")
    for old, new in fedcore._MOVED.items():   # every one of them
        assert importlib.import_module(f"fedcore.{old}") is importlib.import_module(f"fedcore.{new}")
