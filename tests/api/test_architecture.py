"""The shape of the package, checked: what a newcomer relies on when walking the code.

- the layers point one way: a module imports only modules of its own layer or of a lower one,
  type-only imports (``if TYPE_CHECKING:``) included; bottom to top (:data:`LAYERS`):

  1. ``base``: errors, knobs, the native ops and the small shared helpers (latch, workers,
     priority, handle, source_set);
  2. ``storage``: the byte stores (local, remote, atomic writes) and page-level memory
     plumbing (``storage/prefault.py``);
  3. ``format``: what is on disk (names, manifests, markers, records, the memory tier's
     ``ROOT`` owner); it reads through a :class:`~nebula_ckpt.storage.base.Storage`;
  4. ``ranks``: multi-rank agreement (coordinator, fencing, partners, shards);
  5. ``tiers``: the tier kinds, their capabilities and their runtimes, the memory tier's folder,
     slots and claims included;
  6. ``checks``: the API boundary's argument checks and the health records, both read by restore;
  7. ``restore``: opening, checking and reading a checkpoint, resharding included (its DCP
     ``StorageReader`` lives here; ``dcp/`` only exposes it); the memory tier's page adoption
     (``tiers/memory/adopt*.py``: in ``tiers/memory/`` by what it serves, here by what it uses);
  8. ``save``: planning, snapshotting, deciding what a tier writes (the byte compare of a tier that
     keeps its base in RAM included), writing and committing a step;
  9. ``replicas``: the memory tier's copies on a partner node (``tiers/memory/replica*.py``,
     ``recovery.py``), which use restore and save through their public functions; they sit in
     ``tiers/memory/`` by what they keep, and above save by what they use;
  10. ``run``: the orchestration that knows the order: ``save/pipeline.py``,
      ``tiers/memory/epilogue.py`` and ``tiers/memory/gc.py`` (the memory tier's last writes and its
      removal, run by the CLI: they read the root's health marks), ``root.py``, ``checkpointer.py``,
      ``health/reports.py``, ``restore/reads.py``, ``loop/``;
  11. ``adapters``: the public package, ``dcp/``, ``integrations/``, ``compat/``, ``cli/``, the demo
      and the quick benchmark.

  A module's layer is that of the longest name in :data:`LAYERS` it starts with;
- no import cycles between nebula_ckpt's modules, counting imports inside functions; none either
  through type hints (``if TYPE_CHECKING:``), but for those :data:`TYPE_HINT_CYCLES_LEFT` names;
- no module over 500 lines and no function over 60;
- the memory tier is found by what it can do (:class:`~nebula_ckpt.tiers.base.Capabilities`), never by
  what it is: no ``isinstance`` / ``issubclass`` / ``type(x) is`` of a class of ``tiers/memory/``
  outside that folder, no ``not <tier>.shared`` (ask ``capabilities.per_rank`` or the capability
  meant) and no ``.kind == "memory"`` anywhere;
- no module reads another module's private names (``from m import _x``, ``m._x``);
- ``knobs.py`` is the only reader of the environment (and ``compat/nebula/environment.py``, for
  Azure ML Nebula's own variables); it holds at most ``MAX_KNOBS`` knobs, each documented;
- ``integrations/`` and ``compat/`` use the public API only (names in a public module's ``__all__``:
  the user API ``nebula_ckpt``, the seam for integration authors ``nebula_ckpt.adapters``, ...);
- ``nebula_ckpt.__all__`` holds what users call, at most ``MAX_PUBLIC_NAMES`` names;
- the benchmark harness lives outside the installed package.

The rules are read from the source with :mod:`ast`; each failure names the file and line.
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict
from collections.abc import Iterator

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "nebula_ckpt"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
# the public surface integrations and compat may use (each name must be in the module's __all__)
PUBLIC_MODULES = {"nebula_ckpt", "nebula_ckpt.adapters", "nebula_ckpt.errors", "nebula_ckpt.knobs", "nebula_ckpt.dcp",
                  "nebula_ckpt.tiers"}
# names users call (nebula_ckpt.__all__); what only adapters need is in nebula_ckpt.adapters
MAX_PUBLIC_NAMES = 20

_REPLICAS = ("replica_channel", "replica_pull", "replica_recover", "replica_save", "replica_store", "replica_whole",
             "replicas", "recovery")
#: the layers, bottom to top, each a set of module names (a name covers the modules under it); see
#: the module docstring for what each holds
#: the memory tier's parts that run within a stage, mapped to the layer of what they use: its page
#: adoption (restore), persist-memory (run)
_MEMORY_RESTORE = {"tiers.memory.adopt", "tiers.memory.adopt_memory"}
LAYERS: list[tuple[str, set[str]]] = [
    ("base", {"errors", "knobs", "_version", "native", "latch", "workers", "priority", "handle",
              "source_set", "copy_worker"}),
    ("storage", {"storage"}),
    ("format", {"format"}),
    ("ranks", {"ranks"}),
    ("tiers", {"tiers"}),
    ("checks", {"arguments", "health"}),
    ("restore", {"restore"} | _MEMORY_RESTORE),
    ("save", {"save"}),
    ("replicas", {f"tiers.memory.{m}" for m in _REPLICAS}),
    ("run", {"save.pipeline", "tiers.memory.epilogue", "tiers.memory.gc", "root", "checkpointer", "health.reports",
             "restore.reads", "loop"}),
    ("adapters", {"", "dcp", "integrations", "compat", "cli", "demo", "quickbench"}),
]



def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


MODULES = _modules()


def _package_of(name: str, path: pathlib.Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                skip.update(id(n) for n in ast.walk(sub))
    return skip


def _imports(name: str, path: pathlib.Path, type_only: bool = False) -> Iterator[tuple[int, str, list[str]]]:
    """(line, imported module, names taken from it) for every nebula_ckpt import; type-only ones
    (under ``if TYPE_CHECKING:``) only with ``type_only``."""
    tree = ast.parse(path.read_text())
    skip = set() if type_only else _type_checking_nodes(tree)
    pkg = _package_of(name, path)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "nebula_ckpt":
                    yield node.lineno, a.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "nebula_ckpt":
                continue
            plain = []
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in MODULES:
                    yield node.lineno, sub, []
                else:
                    plain.append(a.name)
            if plain:
                yield node.lineno, mod, plain


def _resolve(mod: str) -> str:
    while mod not in MODULES and "." in mod:
        mod = mod.rpartition(".")[0]
    return mod


def _layer(module: str) -> int:
    """The index in :data:`LAYERS` of ``module`` (the layer of the longest name it starts with)."""
    rel = module.removeprefix("nebula_ckpt").removeprefix(".")
    best, found = -1, None
    for i, (_, names) in enumerate(LAYERS):
        for n in names:
            if (rel == n or rel.startswith(n + ".") or n == "") and len(n) > best:
                best, found = len(n), i
    assert found is not None, f"{module} is in no layer: add it to LAYERS"
    return found


def _back_up_imports() -> list[str]:
    found = []
    for name, path in MODULES.items():
        for line, mod, names in _imports(name, path, type_only=True):
            target = _resolve(mod)
            if target == "nebula_ckpt" and names == ["_C"]:
                continue  # the compiled extension, loaded by native.py
            if _layer(target) > _layer(name):
                found.append(f"{path.relative_to(PKG.parent)}:{line} ({LAYERS[_layer(name)][0]}) imports {target} "
                             f"({LAYERS[_layer(target)][0]})")
    return found


def test_every_module_has_a_layer() -> None:
    for name in MODULES:
        _layer(name)


def test_imports_point_down_the_layers() -> None:
    """No module imports one of a higher layer, not even for a type hint."""
    found = _back_up_imports()
    assert not found, f"{len(found)} import(s) back up a layer (see LAYERS):\n" + "\n".join(found)


def _cycles(type_only: bool) -> dict[frozenset[str], str]:
    """Each import cycle (its modules) -> a description naming every import in it."""
    graph: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], str] = {}
    for name, path in MODULES.items():
        for line, mod, _ in _imports(name, path, type_only):
            target = _resolve(mod)
            if target != name and target in MODULES:
                graph[name].add(target)
                where.setdefault((name, target), f"{path.relative_to(PKG.parent)}:{line}")
    # a package's __init__ is run before its modules: an edge *into* a package __init__ from one of
    # its own modules is part of Python's package import, not a cycle of ours
    cycles = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if MODULES[w].name == "__init__.py" and v.startswith(w + "."):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    described = {}
    for comp in cycles:
        edges = [f"{a} -> {b} ({where[(a, b)]})" for a in comp for b in comp if (a, b) in where]
        described[frozenset(comp)] = "cycle: " + ", ".join(comp) + "\n    " + "\n    ".join(edges)
    return described


#: the cycles left that run through type hints only; each entry must still be a cycle (remove it
#: once broken)
TYPE_HINT_CYCLES_LEFT: set[frozenset[str]] = set()


def test_no_import_cycles() -> None:
    cycles = _cycles(type_only=False)
    assert not cycles, "\n".join(cycles.values())


def test_no_import_cycles_even_through_type_hints() -> None:
    cycles = _cycles(type_only=True)
    new = [d for c, d in cycles.items() if c not in TYPE_HINT_CYCLES_LEFT]
    assert not new, "import cycles through type hints (name what you use with a Protocol, or move the type " \
        "below both):\n" + "\n".join(new)
    broken = [sorted(c) for c in TYPE_HINT_CYCLES_LEFT if c not in cycles]
    assert not broken, f"no longer cycles: remove them from TYPE_HINT_CYCLES_LEFT: {broken}"


def _sizes() -> Iterator[tuple[str, int, int]]:
    for name, path in MODULES.items():
        text = path.read_text()
        yield name, len(text.splitlines()), 0
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                yield f"{name}:{node.name}", node.end_lineno - node.lineno + 1, node.lineno


def test_no_module_or_function_too_large() -> None:
    over = []
    for what, n, line in _sizes():
        limit = MAX_FUNCTION_LINES if line else MAX_MODULE_LINES
        if n > limit:
            over.append(f"{what}: {n} lines (limit {limit})")
    assert not over, "split these:\n  " + "\n  ".join(over)


MEMORY_TIER = "nebula_ckpt.tiers.memory"


def _in_memory_tier(name: str) -> bool:
    return name == MEMORY_TIER or name.startswith(MEMORY_TIER + ".")


def _memory_tier_classes() -> set[str]:
    """The names of the classes defined in ``tiers/memory/``."""
    return {node.name for name, path in MODULES.items() if _in_memory_tier(name)
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}


def _names(node: ast.AST) -> set[str]:
    """The names an expression mentions (``m.C`` counts as ``C``)."""
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


def _what_it_is(node: ast.AST, classes: set[str]) -> str | None:
    """How ``node`` asks whether an object is of a memory-tier class (``classes``), or None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 2 \
            and node.func.id in {"isinstance", "issubclass"} and _names(node.args[1]) & classes:
        return ast.unparse(node)
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        if any(isinstance(p, ast.Call) and isinstance(p.func, ast.Name) and p.func.id == "type" for p in sides) \
                and set().union(*map(_names, sides)) & classes:
            return ast.unparse(node)
    return None


def _stands_for_the_memory_tier(node: ast.AST) -> str | None:
    """``not x.shared`` (or ``x.shared == False``) and ``x.kind == "memory"``: the memory tier asked
    for by what it is rather than by the capability the caller needs; None otherwise."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) \
            and isinstance(node.operand, ast.Attribute) and node.operand.attr == "shared":
        return ast.unparse(node)
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        attrs = {p.attr for p in sides if isinstance(p, ast.Attribute)}
        consts = [p.value for p in sides if isinstance(p, ast.Constant)]
        if ("shared" in attrs and any(c is False for c in consts)) or ("kind" in attrs and "memory" in consts):
            return ast.unparse(node)
    return None


def test_the_memory_tier_is_found_by_its_capabilities() -> None:
    """Generic code asks a tier's :class:`~nebula_ckpt.tiers.base.Capabilities` (``per_rank``,
    ``keeps_base_in_ram``, ``hands_pages_to_restart``, ``replicas``), never whether it is the
    memory tier: a per-rank tier of another kind must not be taken for it."""
    classes = _memory_tier_classes()
    assert {"MemoryTier", "MemoryTierRuntime"} <= classes  # the rule reads the right folder
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(PKG.parent)}:{getattr(node, 'lineno', 0)}"
            kind = None if _in_memory_tier(name) else _what_it_is(node, classes)
            if kind is not None:
                found.append(f"{where} asks what a tier is ({kind}): ask the capability it needs")
            stands = _stands_for_the_memory_tier(node)
            if stands is not None:
                found.append(f"{where} stands for the memory tier ({stands}): ask tier.capabilities "
                             "(per_rank, keeps_base_in_ram, hands_pages_to_restart, has_replicas)")
    assert not found, "\n".join(found)


TESTS = PKG.parent / "tests"
#: the test modules of the memory tier: its runtime, slots, adoption, gc, persist-memory, incremental
#: steps, replicas (``replicas/``) and multi-rank jobs (``dist/``, workers included)
MEMORY_TIER_TESTS = TESTS / "tiers" / "memory"
#: the one test module outside :data:`MEMORY_TIER_TESTS` that may import ``nebula_ckpt.tiers.memory``:
#: tests whose subject is something else (commit faults, fencing, the CLI, first contact) still need
#: where a root's memory tier lives and whether its lock is free; that module answers, through the
#: public seam where there is one (``MemoryTier.bind``), so no such test reaches into the tier itself
MEMORY_PATHS_HELPER = TESTS / "memory_paths.py"


def _imported_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, module) for every module a test module imports, wherever the import is (in a function,
    under ``if TYPE_CHECKING:``): ``import m``, ``from m import x`` (``m`` and ``m.x``: ``x`` may be a
    module), ``importlib.import_module("m")`` and ``__import__("m")``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and ast.unparse(node.func) in {
                    "importlib.import_module", "import_module", "__import__"}:
            yield node.lineno, node.args[0].value


def test_memory_tier_tests_live_in_one_folder() -> None:
    """No test module outside ``tests/tiers/memory/`` imports ``nebula_ckpt.tiers.memory`` (but
    :data:`MEMORY_PATHS_HELPER`, for where a root's memory tier lives): a test whose subject is the
    memory tier lives in that folder, one whose subject is something else asks the helper."""
    assert MEMORY_TIER_TESTS.is_dir() and MEMORY_PATHS_HELPER.is_file()  # the rule reads the right places
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if path == MEMORY_PATHS_HELPER or MEMORY_TIER_TESTS in path.parents:
            continue
        lines = sorted({line for line, module in _imported_modules(ast.parse(path.read_text(), str(path)))
                        if _in_memory_tier(module)})
        found += [f"{path.relative_to(PKG.parent)}:{line}" for line in lines]
    assert not found, ("these test modules import nebula_ckpt.tiers.memory: move a memory-tier test under "
                       "tests/tiers/memory/, or ask tests/memory_paths.py where the memory tier lives:\n  "
                       + "\n  ".join(found))


def test_no_private_names_across_modules() -> None:
    found = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}
        for line, mod, names in _imports(name, path):
            target = _resolve(mod)
            for n in names:
                if n.startswith("_") and not n.startswith("__") and n != "_C" and target != name:
                    found.append(f"{path.relative_to(PKG.parent)}:{line} imports {n} from {mod}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nebula_ckpt"):
                for a in node.names:
                    if f"{node.module}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("nebula_ckpt") and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.attr != "_C"
            ):
                found.append(f"{path.relative_to(PKG.parent)}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not found, "\n".join(found)


def _private_definitions() -> dict[str, set[str]]:
    """private name -> modules that define it (a ``def _x``, a ``self._x = ...`` or a class-level ``_x``)."""
    defined: dict[str, set[str]] = defaultdict(set)
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined[node.name].add(name)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                if isinstance(node.ctx, ast.Store):
                    defined[node.attr].add(name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined[node.target.id].add(name)
    return {k: v for k, v in defined.items() if k.startswith("_") and not k.startswith("__")}


def test_no_private_attributes_of_another_modules_objects() -> None:
    """``obj._x`` where ``_x`` belongs to a class of another module (``self._x`` is the class's own)."""
    defined = _private_definitions()
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr in defined):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in {"self", "cls"}:
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            if name not in defined[node.attr]:
                owners = ", ".join(sorted(defined[node.attr]))
                where = f"{path.relative_to(PKG.parent)}:{node.lineno}"
                found.append(f"{where} uses {ast.unparse(node)} (private to {owners})")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("folder", ["integrations", "compat"])
def test_adapters_set_no_private_attributes_on_framework_objects(folder: str) -> None:
    found = []
    for name, path in MODULES.items():
        if not name.startswith(f"nebula_ckpt.{folder}"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"})
            ):
                found.append(f"{path.relative_to(PKG.parent)}:{node.lineno} sets {ast.unparse(node)}")
    assert not found, "\n".join(found)


# the modules that may read os.environ: the knobs, and Nebula's own variables for its compat layer
ENVIRONMENT_READERS = {"nebula_ckpt.knobs", "nebula_ckpt.compat.nebula.environment"}
# knobs a user or operator can act on; the library's internal sizes and waits are module constants
MAX_KNOBS = 20


def test_knobs_is_the_only_reader_of_the_environment() -> None:
    found = []
    for name, path in MODULES.items():
        if name in ENVIRONMENT_READERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in {"environ", "getenv", "environb"}:
                if isinstance(node.value, ast.Name) and node.value.id == "os":
                    found.append(f"{path.relative_to(PKG.parent)}:{node.lineno} reads os.{node.attr}")
    assert not found, "read the environment through nebula_ckpt.knobs:\n" + "\n".join(found)


def test_few_knobs_each_documented() -> None:
    """Every knob is one a user can act on: at most MAX_KNOBS of them, each with a line of
    documentation and a ``NEBULA_`` variable of its own; no knob stands for another program's
    variable (Nebula's are read in compat/)."""
    from nebula_ckpt import knobs

    described = knobs.describe()
    assert len(described) <= MAX_KNOBS, (
        f"{len(described)} knobs (limit {MAX_KNOBS}): make the new one a constructor argument or a named "
        f"constant in the module that uses it: {sorted(described)}")
    undocumented = [n for n, (_, _, doc) in described.items() if len(doc.split()) < 4]
    assert not undocumented, f"knobs without a doc string: {undocumented}"
    envs = [env for env, _, _ in described.values()]
    assert len(set(envs)) == len(envs) and all(e.startswith("NEBULA_") for e in envs), envs
    assert not [e for e in envs if e.startswith("NEBULA_PERSISTENT_") or e == "NEBULA_MEMORY_BUFFER_SIZE"]


def _public_names(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


@pytest.mark.parametrize("folder", ["integrations", "compat"])
def test_adapters_use_the_public_api_only(folder: str) -> None:
    found = []
    for name, path in MODULES.items():
        if not name.startswith(f"nebula_ckpt.{folder}"):
            continue
        for line, mod, names in _imports(name, path):
            if mod.startswith(f"nebula_ckpt.{folder}") or mod.startswith("nebula_ckpt.integrations"):
                continue
            where = f"{path.relative_to(PKG.parent)}:{line}"
            if mod not in PUBLIC_MODULES:
                found.append(f"{where} imports the internal module {mod}")
                continue
            missing = [n for n in names if n not in _public_names(mod)]
            if missing:
                found.append(f"{where} imports {missing} from {mod}, not in its __all__")
    assert not found, "\n".join(found)


def test_the_public_surface_is_small_and_the_seam_is_apart() -> None:
    """``nebula_ckpt.__all__`` is what users call (at most MAX_PUBLIC_NAMES names, each documented);
    what adapters of frameworks need besides is in ``nebula_ckpt.adapters`` (documented for
    integration authors), not in ``__all__`` as well."""
    import nebula_ckpt
    from nebula_ckpt import adapters

    names = list(nebula_ckpt.__all__)
    assert len(names) == len(set(names)) and len(names) <= MAX_PUBLIC_NAMES, (len(names), names)
    assert _public_names("nebula_ckpt") == set(names)  # the static reading the adapters rule uses
    undocumented = [n for n in names if not (getattr(nebula_ckpt, n).__doc__ or "").strip()]
    assert not undocumented, undocumented
    seam = set(adapters.__all__)
    assert seam and all(hasattr(adapters, n) for n in seam)
    assert not seam & set(names), f"in both nebula_ckpt.__all__ and the adapters' seam: {seam & set(names)}"
    assert "integration authors" in (adapters.__doc__ or "")


#: what users import by name: the public modules, and the packages of the adapters and tools users
#: run (their own modules say what they offer); every other package and top-level module says
#: "Internal" (everything under an internal package is internal too)
USER_FACING = PUBLIC_MODULES | {"nebula_ckpt.demo", "nebula_ckpt.quickbench", "nebula_ckpt.cli", "nebula_ckpt.compat",
                                "nebula_ckpt.compat.nebula", "nebula_ckpt.integrations",
                                "nebula_ckpt.integrations.huggingface", "nebula_ckpt.loop"}


def test_internal_modules_say_so() -> None:
    """Each package and top-level module of nebula_ckpt that users do not import by name
    (:data:`USER_FACING`) begins its docstring with "Internal", and none that they do, so a newcomer
    and a user see at the top of a file whether its names are a promise."""
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent)
        is_package = path.name == "__init__.py"
        if not is_package and path.parent != PKG:
            continue  # a module inside a package: its package says it
        name = ".".join(rel.parent.parts if is_package else rel.with_suffix("").parts)
        if name == "nebula_ckpt.__main__" or (not is_package and path.parent.joinpath("__init__.py") == path):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        says = doc.startswith("Internal")
        if says == (name in USER_FACING):
            wrong.append(f"{rel}: {'says Internal but users import it' if says else 'does not begin with Internal'}")
    assert not wrong, wrong


def test_the_benchmark_harness_is_not_installed() -> None:
    assert not (PKG / "bench").exists(), "the benchmark harness belongs in benchmarks/, outside the package"
    shipped = [str(p.relative_to(PKG.parent)) for p in PKG.rglob("*.py") if "emulators" in p.name or "peers" in p.name]
    assert not shipped, shipped


BENCH = PKG.parent / "benchmarks"


def _bench_modules() -> dict[str, pathlib.Path]:
    return {f"benchmarks.{p.stem}" if p.stem != "__init__" else "benchmarks": p for p in sorted(BENCH.glob("*.py"))}


def _bench_imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> Iterator[tuple[int, str, list[str]]]:
    """(line, benchmarks module, names taken from it) for every import of the harness's own modules."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name, []) for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "benchmarks":
            mod = node.module or ""
            subs = [a.name for a in node.names if f"{mod}.{a.name}" in modules]
            yield from ((node.lineno, f"{mod}.{s}", []) for s in subs)
            plain = [a.name for a in node.names if a.name not in subs]
            if plain and mod in modules:
                yield node.lineno, mod, plain


def test_the_benchmark_harness_has_the_package_shape() -> None:
    """benchmarks/ (outside the package) keeps the package's rules: no import cycles (imports inside
    functions count), no module over 500 lines or function over 60, no private names across modules."""
    modules = _bench_modules()
    graph: dict[str, set[str]] = defaultdict(set)
    problems = []
    for name, path in modules.items():
        rel = path.relative_to(BENCH.parent)
        for line, mod, names in _bench_imports(path, modules):
            if mod != name and mod != "benchmarks":
                graph[name].add(mod)
            problems += [f"{rel}:{line} imports {n} from {mod}" for n in names if n.startswith("_")]
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            problems.append(f"{rel}: {len(text.splitlines())} lines (limit {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    problems.append(f"{rel}:{node.lineno} {node.name}: {n} lines (limit {MAX_FUNCTION_LINES})")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_") \
                    and not node.attr.startswith("__") and f"benchmarks.{node.value.id}" in modules:
                problems.append(f"{rel}:{node.lineno} reads {node.value.id}.{node.attr}")

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            v = todo.pop()
            if v == goal:
                return True
            if v not in seen:
                seen.add(v)
                todo.extend(graph.get(v, ()))
        return False

    problems += sorted({f"cycle: {a} -> {b} -> ... -> {a}" for a in graph for b in graph[a] if reaches(b, a)})
    assert not problems, "\n".join(problems)


#: the modules outside ``format/`` that read or write JSON which is no format file of ours (no
#: manifest, marker, records file or root record), and what that JSON is
JSON_NOT_FORMAT = {
    "nebula_ckpt.demo": "the demo's own log (JSON lines)",
    "nebula_ckpt.quickbench": "the quick benchmark's --json output",
    "nebula_ckpt.cli": "--json output: the error object of a command that failed",
    "nebula_ckpt.cli.common": "--storage-options, a JSON object given on the command line",
    "nebula_ckpt.cli.doctor": "--json output",
    "nebula_ckpt.cli.gc": "--json output",
    "nebula_ckpt.cli.listing": "--json output",
    "nebula_ckpt.cli.mark": "--json output",
    "nebula_ckpt.cli.persist_memory": "--json output",
    "nebula_ckpt.cli.verify": "--json output",
    "nebula_ckpt.cli.export": "--json output and the exported files: a plain safetensors file's __metadata__ and "
                              "HF's config.json, files of other tools",
    "nebula_ckpt.dcp.shard": "a canonical text of a DCP item's record, to tell items apart in memory (never stored)",
    "nebula_ckpt.integrations.pointers": "the pointer files an integration leaves at a framework's path (the "
                                         "integration's own records, outside every checkpoint, versioned by it)",
    "nebula_ckpt.integrations.huggingface.folders": "the pointer file in a HF checkpoint folder (the integration's)",
    "nebula_ckpt.integrations.huggingface.saving": "HF's trainer_state, kept as the JSON text HF writes",
    "nebula_ckpt.integrations.huggingface.export": "HF's trainer_state and config.json",
    "nebula_ckpt.integrations.huggingface.resuming": "HF's trainer_state.json",
}
_JSON_CODECS = {"loads", "dumps", "load", "dump", "JSONDecoder", "JSONEncoder"}


def _json_uses(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, what) for every use of the json module's codecs (``json.loads(...)``, ``from json
    import dumps``, ``import json as j`` ... ``j.load``)."""
    names = {"json"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname for a in node.names if a.name == "json" and a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "json":
            for a in node.names:
                if a.name in _JSON_CODECS:
                    yield node.lineno, f"from json import {a.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in _JSON_CODECS and isinstance(node.value, ast.Name)
                and node.value.id in names):
            yield node.lineno, f"{node.value.id}.{node.attr}"


def _format_records_built(tree: ast.AST) -> Iterator[int]:
    """Lines of dict displays with both a ``"format"`` and a ``"version"`` key (a format record's head)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if {"format", "version"} <= keys:
                yield node.lineno


def test_no_format_file_built_or_parsed_outside_format() -> None:
    """Format files (manifests, markers, records files, ``ranks.json``, root records) are built and
    parsed in ``format/`` only: no module elsewhere encodes or decodes JSON (but those of
    :data:`JSON_NOT_FORMAT`, whose JSON is no format file), and none builds a record with a
    ``format`` and a ``version`` field."""
    found = []
    used = set()
    for name, path in MODULES.items():
        if name.startswith("nebula_ckpt.format.") or name == "nebula_ckpt.format":
            continue
        tree = ast.parse(path.read_text())
        where = path.relative_to(PKG.parent)
        for line, what in _json_uses(tree):
            if name in JSON_NOT_FORMAT:
                used.add(name)
            else:
                found.append(f"{where}:{line} uses {what}")
        found += [f"{where}:{line} builds a record with format and version fields" for line in
                  _format_records_built(tree)]
    assert not found, ("build and parse format files in nebula_ckpt/format/ (or, for JSON that is no format file, "
                       "add the module to JSON_NOT_FORMAT saying what it is):\n" + "\n".join(found))
    stale = sorted(set(JSON_NOT_FORMAT) - used)
    assert not stale, f"no longer use JSON: remove them from JSON_NOT_FORMAT: {stale}"
