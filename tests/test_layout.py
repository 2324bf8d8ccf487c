"""The package's shape: imports at the top of each file, no import cycle, leaf API types."""

from __future__ import annotations

import ast
import pathlib

import fsdptag

PACKAGE = pathlib.Path(fsdptag.__file__).parent


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text())
    return out


def _package_of(module: str, mods: dict) -> str:
    is_package = (PACKAGE.parent / module.replace(".", "/") / "__init__.py").exists()
    return module if is_package else module.rsplit(".", 1)[0]


def _ours(module: str, node: ast.AST, mods: dict) -> list[str]:
    """The fsdptag modules an import statement in ``module`` names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "fsdptag"]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = _package_of(module, mods)
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            prefix = f"{base}.{node.module}" if node.module else base
            return [prefix] + [f"{prefix}.{a.name}" for a in node.names]
        if node.module and node.module.split(".")[0] == "fsdptag":
            return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, tree in mods.items():
        deps = set()
        # Top level only (function-level imports are checked below), `if TYPE_CHECKING:`
        # blocks included: an import for annotations is an edge like any other (issue 21).
        for node in tree.body:
            for stmt in node.body + node.orelse if isinstance(node, ast.If) else [node]:
                deps.update(t for t in _ours(name, stmt, mods) if t in mods and t != name)
        graph[name] = deps
    return graph


def test_every_import_is_at_the_top_of_its_file():
    late = []
    for name, tree in _modules().items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                late += [f"{name}:{n.lineno}" for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert late == []


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_api_types_are_a_leaf():
    graph = _graph()
    assert graph["fsdptag._api"] == set()
    compat = [m for m in graph if m == "fsdptag._compat" or m.startswith("fsdptag._compat.")]
    assert all(dep.startswith("fsdptag._compat.") for m in compat for dep in graph[m]), {m: graph[m] for m in compat}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_lower_layers_hold_no_owner():
    """Top-down (issue 21): a parameter's gather knows nothing of buckets or the root; a
    bucket, its autograd Function and its compiled gather know nothing of the root, its
    scopes or the parameter read that decides between bucket and parameter."""
    graph = _graph()
    above = {"fsdptag._param": {"fsdptag._bucket", "fsdptag._access", "fsdptag._state"},
             "fsdptag._bucket": {"fsdptag._access", "fsdptag._scopes", "fsdptag._state", "fsdptag._bucket_gather",
                                 "fsdptag._compiled"},
             "fsdptag._bucket_gather": {"fsdptag._access", "fsdptag._state"},
             "fsdptag._compiled": {"fsdptag._access", "fsdptag._state"},
             "fsdptag._access": {"fsdptag._state", "fsdptag._scopes", "fsdptag._plan"}}
    assert {m: sorted(_reachable(graph, m) & up) for m, up in above.items()} == {m: [] for m in above}


def test_the_runtime_imports_no_tool_and_no_fixture():
    """``import fsdptag`` (and every runtime module) reaches neither the tools (estimator,
    planner, reference model) nor the test fixtures; the tools reach no fixture."""
    graph = _graph()
    runtime = [m for m in graph if m == "fsdptag" or m.startswith(("fsdptag._", "fsdptag.debug"))]
    for m in runtime:
        bad = {d for d in _reachable(graph, m) if d.startswith(("fsdptag.tools", "fsdptag.testing",
                                                                "fsdptag.estimate", "fsdptag.plan"))}
        assert not bad, (m, sorted(bad))
    for m in (m for m in graph if m.startswith("fsdptag.tools")):
        assert not {d for d in _reachable(graph, m) if d.startswith("fsdptag.testing")}, m


def test_entry_points_are_the_tools():
    """``python -m fsdptag.estimate`` / ``fsdptag.plan`` and their Python names are the tools."""
    import fsdptag.estimate
    import fsdptag.plan
    from fsdptag.tools import estimate, plan

    assert fsdptag.estimate.estimate is estimate.estimate and fsdptag.estimate.main is estimate.main
    assert fsdptag.plan.plan is plan.plan and fsdptag.plan.main is plan.main
    assert set(fsdptag.estimate.__all__) <= set(dir(fsdptag.estimate))


def test_no_file_over_400_lines():
    """Issue 21's house rule: a file past ~400 lines has more than one role; split it."""
    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {f: n for f, n in sizes.items() if n > 400} == {}
