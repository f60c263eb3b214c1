"""The layers hold: the library never imports prefect or the orchestration, no stage imports another
stage, and the import graph has no cycle (every module-level and function-level import counts)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Stage packages/modules: each may import the shared modules below it (eagle3.data's readers and
# template among them), never another stage.
STAGES = {"eagle3.data.prepare", "eagle3.extract", "eagle3.verifier", "eagle3.train", "eagle3.eval",
          "eagle3.regenerate"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of the file (functions included)."""
    out: set[str] = set()
    pkg = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def graph() -> dict[str, set[str]]:
    mods = {module_name(p): p for d in ("eagle3", "tasks", "flows") for p in (REPO / d).rglob("*.py")}
    return {m: {i for i in imports(p) if i in mods} for m, p in mods.items()}


def stage_of(mod: str) -> str | None:
    return next((s for s in STAGES if mod == s or mod.startswith(s + ".")), None)


def test_library_never_imports_prefect_or_orchestration():
    bad = {}
    for p in (REPO / "eagle3").rglob("*.py"):
        hit = sorted(i for i in imports(p) if i.split(".")[0] in ("prefect", "flows", "tasks"))
        if hit:
            bad[module_name(p)] = hit
    assert not bad, bad


def test_no_stage_imports_another_stage():
    g = graph()
    bad = sorted((m, i) for m, deps in g.items() for i in deps
                 if stage_of(m) and stage_of(i) and stage_of(m) != stage_of(i))
    assert not bad, bad


def test_import_graph_has_no_cycle():
    g = graph()
    # a package's own modules import each other through the package: ignore parent <-> child edges
    g = {m: {i for i in deps if not (m.startswith(i + ".") or i.startswith(m + "."))} for m, deps in g.items()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, path: list[str]) -> bool:
        state[m] = 1
        for n in sorted(g[m]):
            if state.get(n) == 1:
                cycle.extend(path[path.index(n):] + [n] if n in path else [m, n])
                return True
            if n not in state and visit(n, [*path, n]):
                return True
        state[m] = 2
        return False

    for m in sorted(g):
        if m not in state and visit(m, [m]):
            break
    assert not cycle, " -> ".join(cycle)
