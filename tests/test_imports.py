"""The plain imports between numbered folders: each module loads once, every entry point runs from
anywhere, and an editor follows the imports to their files.

Folder names begin with digits, so they are not importable names. Each entry point (a train.py, the
planner, generate/export_hf, the kernel scripts) puts the folders it builds on at the front of
`sys.path`, and modules import each other by their plain names (`import model`); pytest and pyright get
the same folders from pyproject.toml. That holds only while no two modules share a name and nothing
imports a module under a second, dotted name. And imports follow ownership: no module imports, even
inside a function, one that imports it back.
"""
import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = sorted([p for p in ROOT.glob("0[1-8]_*") if p.is_dir()] + [ROOT / "01_single_gpu" / "runtime"])
MODULES = {py.stem: py for folder in FOLDERS for py in sorted(folder.glob("*.py")) if py.stem != "train"}
SOURCES = sorted(py for py in ROOT.rglob("*.py") if not {".git", ".cache"} & set(py.parts))
ENTRY_POINTS = [py for py in SOURCES if py.parent.name != "tests" and "\nsys.path[:0] = [" in py.read_text()]


def imported_names(py: Path) -> set:
    """The repository modules `py` imports by plain name, and the train.py files it imports by dotted name."""
    names = set()
    for node in ast.walk(ast.parse(py.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).endswith(".train")):
            names.add(node.args[0].value)
    return names


def folders_needed(py: Path, seen=None) -> set:
    """Every folder whose modules `py` reaches through its imports, transitively."""
    seen = set() if seen is None else seen
    folders = set()
    for name in imported_names(py):
        target = ROOT / name.split(".")[0] / "train.py" if name.endswith(".train") else MODULES.get(name)
        if target is None or target in seen:
            continue
        seen.add(target)
        if not name.endswith(".train"):
            folders.add(target.parent)
        folders |= folders_needed(target, seen)
    return folders


def bootstrap_folders(py: Path) -> set:
    """The folders an entry point's `sys.path[:0] = [ROOT, os.path.join(ROOT, "01_single_gpu"), ...]`
    names."""
    for node in ast.walk(ast.parse(py.read_text())):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript) \
                and ast.unparse(node.targets[0]) == "sys.path[:0]":
            return {ROOT.joinpath(*[a.value for a in call.args[1:]]) for call in node.value.elts
                    if isinstance(call, ast.Call)}
    raise AssertionError(f"{py}: no `sys.path[:0] = [...]` bootstrap")


def test_no_two_modules_share_a_name_or_shadow_an_installed_one():
    stems = [py.stem for folder in FOLDERS for py in folder.glob("*.py") if py.stem != "train"]
    twice = sorted({s for s in stems if stems.count(s) > 1})
    assert not twice, f"modules that share a name (one would hide the other on the path): {twice}; rename one"
    installed = set(sys.stdlib_module_names) | set(metadata.packages_distributions())
    shadowing = sorted(set(stems) & installed)
    assert not shadowing, f"modules named like a standard or installed package: {shadowing}; rename them"


def test_no_module_is_imported_under_a_second_dotted_name():
    """`import_module` of "02_data_parallel.comm" beside `import comm` would load comm.py twice, as two
    modules with two copies of every class: only the train.py files, which share a name, are imported
    dotted."""
    dotted = re.compile(r"""import_module\(f?["']0\d_\w+\.(?!train["'])""")
    found = [f"{py.relative_to(ROOT)}:{n}" for py in SOURCES
             for n, line in enumerate(py.read_text().splitlines(), 1) if dotted.search(line)]
    assert not found, f"dotted imports of a shared module (import it by its plain name instead): {found}"


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_entry_point_puts_the_folders_it_builds_on_on_the_path(entry):
    """Run from anywhere (`python /elsewhere/04_tensor_parallel/train.py`), an entry point finds every module
    it reaches, and names no folder it does not need (the list is the lineage a reader sees)."""
    needed = folders_needed(entry) | ({entry.parent} & set(FOLDERS))
    listed = bootstrap_folders(entry)
    missing = sorted(str(f.relative_to(ROOT)) for f in needed - listed)
    extra = sorted(str(f.relative_to(ROOT)) for f in listed - needed)
    assert not missing and not extra, (f"{entry.relative_to(ROOT)}'s sys.path bootstrap: add {missing}, "
                                       f"remove {extra}")


def goto_misses(jedi, project, files) -> tuple:
    """(uses resolved, [the uses that were not]): jedi's go-to-definition on the first use in code of each
    repository module a file imports by plain name (`module.name`), which must land in that module's file."""
    unresolved, resolved = [], 0
    for py in files:
        source = py.read_text()
        tree, script = ast.parse(source), jedi.Script(source, path=py, project=project)
        aliases = {a.asname or a.name: a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for a in node.names if a.name in MODULES and a.name != py.stem}
        uses = sorted((node.end_lineno, node.end_col_offset - len(node.attr), node.value.id)
                      for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                      and isinstance(node.value, ast.Name) and node.value.id in aliases)
        firsts = {alias: (line, column) for line, column, alias in reversed(uses)}
        for alias, where in sorted(firsts.items()):
            found = script.goto(*where, follow_imports=True)
            target = MODULES[aliases[alias]]
            if any(d.module_path is not None and Path(d.module_path) == target for d in found):
                resolved += 1
            else:
                unresolved.append(f"{py.relative_to(ROOT)}:{where[0]} {aliases[alias]}")
    return resolved, unresolved


def test_an_editor_follows_every_plain_import_of_the_trainers():
    """jedi (the engine of several editors' go-to-definition) reads the bootstrap's `sys.path[:0]` and must
    resolve each `module.name` a train.py uses to that module's file in the repository."""
    jedi = pytest.importorskip("jedi",
                               reason="jedi is pinned in requirements.txt: pip install -r requirements.txt")
    resolved, unresolved = goto_misses(jedi, jedi.Project(ROOT), sorted(ROOT.glob("0[1-8]_*/train.py")))
    assert resolved > 40 and not unresolved, f"go-to-definition failed at {unresolved} ({resolved} resolved)"


def test_an_editor_given_the_readmes_setting_follows_every_module():
    """The modules without a bootstrap (all but the entry points) import across folders by plain name: an
    editor finds them through the folders pyproject.toml lists ([tool.pyright] extraPaths, which pyright
    and Pylance read), and the README's first screen says so and names the setting for jedi-based editors.
    With those folders, jedi resolves every such use to its file."""
    jedi = pytest.importorskip("jedi",
                               reason="jedi is pinned in requirements.txt: pip install -r requirements.txt")
    import tomllib
    paths = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pyright"]["extraPaths"]
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:50])
    assert "jedi" in first_screen and "extraPaths" in first_screen and "pyproject.toml" in first_screen
    assert {str(f.relative_to(ROOT)) for f in FOLDERS} == set(paths)       # every folder, none extra
    project = jedi.Project(ROOT, added_sys_path=[str(ROOT / p) for p in paths], smart_sys_path=False)
    modules = [py for py in MODULES.values() if py not in ENTRY_POINTS]
    resolved, unresolved = goto_misses(jedi, project, modules)
    assert resolved > 80 and not unresolved, f"go-to-definition failed at {unresolved} ({resolved} resolved)"


# ======================================================================================
# Imports follow ownership: no cycle
# ======================================================================================
GRAPH_MODULES = {**MODULES,
                 **{f"{py.parent.name}.train": py for py in sorted(ROOT.glob("0[1-8]_*/train.py"))},
                 **{f"kernels.{py.stem}": py for py in sorted((ROOT / "kernels").glob("*.py"))
                    if py.stem != "__init__"}}


def repository_imports(py: Path) -> set:
    """The repository modules `py` imports anywhere in it, inside functions too: by plain name, a train.py
    by dotted name, the kernels as `from kernels import x`, `from kernels.x import y`, `import kernels.x`."""
    names = set()
    for node in ast.walk(ast.parse(py.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names} | {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module.split(".")[0], node.module}
            names |= {f"{node.module}.{a.name}" for a in node.names}
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant)):
            names.add(str(node.args[0].value))
    return names & set(GRAPH_MODULES)


def import_cycles(graph: dict) -> list:
    """One cycle [a, b, …, a] for each set of modules that import each other round (depth-first search:
    an import of a module still on the search's path closes a cycle)."""
    state, path, found = {}, [], {}

    def visit(node):
        state[node] = "open"
        path.append(node)
        for imported in sorted(graph.get(node, ())):
            if state.get(imported) == "open":
                cycle = path[path.index(imported):] + [imported]
                found.setdefault(frozenset(cycle), cycle)
            elif imported not in state:
                visit(imported)
        path.pop()
        state[node] = "done"
    for node in sorted(graph):
        if node not in state:
            visit(node)
    return sorted(found.values())


def test_no_import_cycle():
    """Imports follow ownership: a module that defines a type or a formula is imported by its users and
    imports none of them back, not even inside a function (an import moved into a function to break a
    cycle hides it; it does not remove it). The detector on graphs it must flag and pass, the graph's
    edges (one inside a function among them), then the repository's graph: every module of the numbered
    folders, runtime/ and kernels/."""
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    graph = {name: repository_imports(path) - {name} for name, path in GRAPH_MODULES.items()}
    assert {"mappings", "materialize"} <= graph["tensor_parallel"]            # plain names, across folders
    assert {"zero", "data_parallel", "build"} <= graph["03_zero.train"]
    assert "kernels.flash_attention" in graph["kernels.bench"]                 # imported inside a function
    assert "model" in graph["kernels.patch"] and "kernels.child_process" in graph["kernels.gpu_run"]
    found = [" -> ".join(cycle) for cycle in import_cycles(graph)]
    assert not found, ("modules that import each other round (the module that owns the type or formula "
                       "imports none of its users; move what both need to its owner):\n" + "\n".join(found))
