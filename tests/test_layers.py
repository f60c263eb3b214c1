"""The layers hold: the library never imports prefect or the orchestration; its groups import only
groups below them; no stage imports another stage; every module belongs to a group; and the import
graph has no cycle (every module-level and function-level import counts)."""
from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The library's groups, lowest first: a module imports its own group or a lower one, never a higher.
GROUPS = [
    ("storage", {"eagle3", "eagle3.storage", "eagle3.runtime"}),  # files, hashes, locks, manifests; host runtime
    ("model", {"eagle3.model"}),  # the target, the draft's forward pass, head formats, capture
    ("config", {"eagle3.config", "eagle3.form", "eagle3.flags", "eagle3.stage"}),  # typed configs, their run form and
    # flags, the stage face
    ("decoding", {"eagle3.decoding"}),  # greedy decoding, KV cache, CPU linears, chains
    ("data", {"eagle3.data"}),  # conversation readers, normalization, template + loss mask, vocab map
    ("stages", {"eagle3.regenerate", "eagle3.prepare", "eagle3.extract", "eagle3.verifier", "eagle3.train",
                "eagle3.eval"}),
    # sizes and times of a run before it starts (it runs prepare's own stream over a sample of the source); the
    # host's speed
    ("planning", {"eagle3.planning", "eagle3.probe"}),
    ("commands", {"eagle3.cli", "eagle3.registry", "eagle3.checksums", "eagle3.assets"}),  # what the user runs
]
# Stage packages: each may import the groups below it, never another stage.
STAGES = GROUPS[[g for g, _ in GROUPS].index("stages")][1]


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


def owner(mod: str, prefixes) -> str | None:
    """The longest prefix in `prefixes` that `mod` is or lies under ("eagle3" only for the package itself)."""
    hits = [p for p in prefixes if mod == p or (p != "eagle3" and mod.startswith(p + "."))]
    return max(hits, key=len) if hits else None


def group_of(mod: str) -> int | None:
    return next((i for i, (_, prefixes) in enumerate(GROUPS) if owner(mod, prefixes)), None)


def test_every_library_module_has_a_group():
    orphans = sorted(m for m in graph() if m.startswith("eagle3") and group_of(m) is None)
    assert not orphans, f"modules outside every group of GROUPS: {orphans}"


def test_groups_import_only_groups_below():
    g = graph()
    bad = sorted((m, GROUPS[group_of(m)][0], i, GROUPS[group_of(i)][0]) for m, deps in g.items()
                 if m.startswith("eagle3") for i in deps
                 if i.startswith("eagle3") and group_of(i) is not None and group_of(m) is not None
                 and group_of(i) > group_of(m))
    assert not bad, "upward imports (module, its group, imported, that group): " + repr(bad)


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


def test_every_stage_package_is_registered_once_with_its_whole_face():
    """Adding a stage is one package with a STAGE: the CLI, the tasks' keys and the flow's table follow."""
    from eagle3.registry import COMMANDS
    from eagle3.registry import STAGES as REGISTERED
    from eagle3.stage import Stage

    assert set(REGISTERED) == {p.removeprefix("eagle3.") for p in STAGES}
    for name, s in REGISTERED.items():
        assert isinstance(s, Stage) and s.name == name and COMMANDS[name] is s
        assert all((s.manifest, s.run, s.inputs, s.summary, s.headline)), name
        assert (REPO / "tasks" / f"{name}.py").is_file(), f"stage {name} has no Prefect task module"
        # a name in the package's face must not shadow a submodule (`import eagle3.extract.run as er`)
        pkg = importlib.import_module(f"eagle3.{name}")
        for sub in pkgutil.iter_modules(pkg.__path__):
            if sub.name != "__main__":
                mod = importlib.import_module(f"eagle3.{name}.{sub.name}")
                assert getattr(pkg, sub.name) is mod, f"eagle3.{name}.{sub.name} is shadowed in the package"

    from eagle3.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    assert list(sub.choices) == list(COMMANDS)


def test_flow_stage_table_is_the_registry():
    from eagle3.registry import STAGES as REGISTERED
    from flows.stages import GPU_STAGES
    from flows.stages import STAGES as FLOW

    assert list(FLOW) == list(REGISTERED)
    assert GPU_STAGES == ("extract", "train", "eval")
    for name, s in FLOW.items():
        assert s.task.name == name and s.manifest is REGISTERED[name].manifest


# ---------------------------------------------------------------- house rules
def sources(*roots: str) -> list[Path]:
    return sorted(p for r in roots for p in (REPO / r).rglob("*.py"))


def test_one_progress_meter():
    """Progress, rate and ETA live in eagle3/runtime/progress.py: no other module draws a bar or defines a
    progress class of its own."""
    home = REPO / "eagle3" / "runtime" / "progress.py"
    found = []
    for p in sources("eagle3", "tasks", "flows"):
        if p == home:
            continue
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tqdm":
                found.append(f"{p.relative_to(REPO)}:{node.lineno} imports tqdm")
            if isinstance(node, ast.ClassDef) and any(w in node.name for w in ("Progress", "Pace", "Meter", "Eta")):
                found.append(f"{p.relative_to(REPO)}:{node.lineno} class {node.name}")
    assert not found, found


def test_no_failure_is_classified_by_a_substring_of_its_message():
    """A failure's kind travels as a type or a field (tasks/_failures.py), never as `"...Error" in message`."""
    found = []
    for p in sources("eagle3", "tasks", "flows", "deployments"):
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant)
                    and isinstance(node.left.value, str) and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops)
                    and any(w in node.left.value for w in ("Error", "Gone", "Exception", "Refused"))):
                found.append(f"{p.relative_to(REPO)}:{node.lineno} {node.left.value!r} in ...")
    assert not found, found


def test_flows_hold_no_module_global_mutable_state():
    """A flow's state belongs to its run: a module-level dict, list or set in flows/ would be shared by every
    flow run in the process (a worker runs many). Tables built once at import (names in CAPITALS) are read-only
    by convention and allowed."""
    found = []
    for p in sources("flows"):
        for node in ast.parse(p.read_text()).body:
            targets = ([t for t in node.targets] if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
            value = getattr(node, "value", None)
            mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
                isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                and value.func.id in ("dict", "list", "set", "defaultdict", "OrderedDict", "Counter"))
            for t in targets:
                if mutable and isinstance(t, ast.Name) and not t.id.isupper():
                    found.append(f"{p.relative_to(REPO)}:{node.lineno} {t.id}")
    assert not found, found


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 450, 60


def test_modules_and_functions_stay_small_unless_they_say_why():
    """A module over 450 lines says in its docstring why it is "one module on purpose" (or file); a function
    over 60 lines says "one piece on purpose". Everything else is split where it has seams."""
    long_modules, long_functions = [], []
    for path in sorted(p for d in ("eagle3", "tasks", "flows") for p in (REPO / d).rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        doc = " ".join((ast.get_docstring(tree) or "").lower().split())
        if len(text.splitlines()) > MAX_MODULE_LINES and not ("one module on purpose" in doc
                                                              or "one file on purpose" in doc):
            long_modules.append(f"{path.relative_to(REPO)} ({len(text.splitlines())} lines)")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                why = " ".join((ast.get_docstring(node) or "").lower().split())
                if n > MAX_FUNCTION_LINES and "one piece on purpose" not in why:
                    long_functions.append(f"{path.relative_to(REPO)}:{node.name} ({n} lines)")
    assert not long_modules and not long_functions, (long_modules, long_functions)
