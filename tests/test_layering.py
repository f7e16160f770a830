"""Dependencies run one way (issue 16): every import in the package, at module level or inside a
function, goes down the layers, never up or sideways, and no modules import each other in a loop.

    foundation (edgefinfer.<room>.*: files, libraries, tokenization, model, data, decoding, bundle)
      -> prune -> distill        the build side: compression          (A -> B: B may import A)
      -> compile                 the build side: exporters
      -> runtime -> server_gpu   the inference side: one sequence on a device, batching on a server
      -> app                     on top of all of them: the CLI, build, peer-runner checks (orchestration)

The inference side never imports the build side: a phone install has no exporter, no torchao, no
training code (tests/test_runtime_only_install.py checks that at run time; this checks every line).
A `__main__` module is a launcher that nothing imports, so it belongs to the app layer.

Inside the foundation the same rule holds between its rooms (issue 33): each room imports only the
rooms below it (ROOMS) and the root module `edgefinfer.errors`, and no module lives outside a room.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "edgefinfer"

# What each layer may import besides itself. Each edge is a reason, not a convenience.
ALLOWED: dict[str, frozenset[str]] = {
    "foundation": frozenset(),
    "prune": frozenset({"foundation"}),
    # A student is the teacher pruned structurally, then trained (Minitron): distillation builds on pruning.
    "distill": frozenset({"foundation", "prune"}),
    "compile": frozenset({"foundation"}),
    "runtime": frozenset({"foundation"}),
    "server_gpu": frozenset({"foundation", "runtime"}),
    "app": frozenset({"foundation", "prune", "distill", "compile", "runtime", "server_gpu"}),
}
SUBPACKAGE_LAYERS = ("app", "distill", "prune", "compile", "runtime", "server_gpu")

# The foundation's rooms: what each may import besides itself and the root. Each edge is a reason.
ROOMS: dict[str, frozenset[str]] = {
    "files": frozenset(),
    "libraries": frozenset(),
    # A tokenizer file is untrusted input: its size and JSON are checked before `tokenizers` parses it.
    "tokenization": frozenset({"files"}),
    # Corpora are fetched once into the user cache and written atomically.
    "data": frozenset({"files"}),
    # A GGUF carries its own tokenizer; checkpoints are untrusted input and written atomically.
    "model": frozenset({"files", "tokenization"}),
    # The eager loop runs the model through its KV cache; constraints and stop rules read the vocabulary.
    "decoding": frozenset({"tokenization", "model"}),
    # A manifest names files and their hashes; resolving a MODEL path finds its tokenizer and stop ids.
    "bundle": frozenset({"files", "tokenization", "model", "decoding"}),
}
# The foundation's modules outside any room: the package itself and the error every room raises.
ROOT_MODULES = frozenset({PACKAGE, f"{PACKAGE}.errors"})


@dataclass(frozen=True)
class Violation:
    """An import against the layers (or, when `rooms`, against the foundation's rooms)."""
    file: str
    line: int
    module: str
    imported: str
    rooms: bool = False

    def __str__(self) -> str:
        if self.rooms:
            mine, theirs = room_of(self.module), room_of(self.imported)
            return (f"{self.file}:{self.line}: {self.module} (room {mine}) imports {self.imported} (room {theirs}); "
                    f"{mine} may import only {', '.join(sorted(ROOMS[mine])) or 'itself'} and the root")
        return (f"{self.file}:{self.line}: {self.module} ({layer_of(self.module)}) imports {self.imported} "
                f"({layer_of(self.imported)}); {layer_of(self.module)} may import only "
                f"{', '.join(sorted(ALLOWED[layer_of(self.module)])) or 'itself'}")


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] != PACKAGE:
        raise ValueError(f"{module} is not in {PACKAGE}")
    if "__main__" in parts:
        return "app"
    return parts[1] if len(parts) > 1 and parts[1] in SUBPACKAGE_LAYERS else "foundation"


def room_of(module: str) -> str:
    """The foundation room of `module` (its second dotted component), or "root" for ROOT_MODULES."""
    if layer_of(module) != "foundation":
        raise ValueError(f"{module} is not in the foundation")
    if module in ROOT_MODULES:
        return "root"
    room = module.split(".")[1]
    if room not in ROOMS:
        raise ValueError(f"{module} is in no room of the foundation (ROOMS: {', '.join(ROOMS)})")
    return room


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the installed package, by dotted name, from pyproject's package-dir."""
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules: dict[str, Path] = {}
    for package in tool["packages"]:
        folder = root / tool["package-dir"].get(package, package.replace(".", "/"))
        for path in sorted(folder.glob("*.py")):  # subpackages are listed on their own
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:`: imports for annotations, never run."""
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body for n in ast.walk(stmt)}


def imported_modules(module: str, source: str, is_package: bool, known: set[str],
                     type_only: bool = True) -> list[tuple[int, str]]:
    """(line, module) for every import of the package in `source`, wherever it stands (without those
    under `if TYPE_CHECKING:` when not `type_only`). `from a import b` counts as importing a.b when
    that is a module (e.g. `from edgefinfer.model import reference`)."""
    here = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    skip = set() if type_only else _type_only(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base.split(".")[0] != PACKAGE:
                continue
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            found += [(node.lineno, m) for m in subs] or [(node.lineno, base)]
    return found


def violations(sources: dict[str, tuple[str, str, bool]]) -> list[Violation]:
    """sources: module -> (file shown in messages, source text, is a package __init__)."""
    known = set(sources)
    bad = []
    for module, (file, text, is_package) in sorted(sources.items()):
        mine = layer_of(module)
        for line, imported in imported_modules(module, text, is_package, known):
            theirs = layer_of(imported)
            if theirs != mine and theirs not in ALLOWED[mine]:
                bad.append(Violation(file, line, module, imported))
            elif mine == theirs == "foundation" and not room_may_import(room_of(module), room_of(imported)):
                bad.append(Violation(file, line, module, imported, rooms=True))
    return sorted(bad, key=lambda v: (v.file, v.line))


def room_may_import(mine: str, theirs: str) -> bool:
    return theirs in (mine, "root") or mine != "root" and theirs in ROOMS[mine]


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the import graph as [a, b, ..., a], or None (depth-first search)."""
    on_path: list[str] = []
    done: set[str] = set()

    def visit(v: str) -> list[str] | None:
        on_path.append(v)
        for w in sorted(graph.get(v, ())):
            if w in on_path:
                return on_path[on_path.index(w):] + [w]
            if w not in done and (cycle := visit(w)):
                return cycle
        done.add(on_path.pop())
        return None

    return next((c for v in sorted(graph) if v not in done and (c := visit(v))), None)


def run_time_graph(sources: dict[str, tuple[str, str, bool]]) -> dict[str, set[str]]:
    known = set(sources)
    return {m: {i for _, i in imported_modules(m, text, is_package, known, type_only=False) if i in known} - {m}
            for m, (_, text, is_package) in sources.items()}


def read_sources(modules: dict[str, Path]) -> dict[str, tuple[str, str, bool]]:
    return {m: (str(p.relative_to(ROOT)), p.read_text(), p.stem == "__init__") for m, p in modules.items()}


def test_every_import_goes_down_the_layers():
    modules = package_modules()
    assert {layer_of(m) for m in modules} == set(ALLOWED)  # every layer is found, so none is skipped
    assert "edgefinfer.app.cli" in modules and "edgefinfer.runtime.backends.ort" in modules
    bad = violations(read_sources(modules))
    assert not bad, "imports against the layering:\n" + "\n".join(map(str, bad))


def test_every_foundation_module_is_in_a_room():
    """A flat module beside the rooms is the foundation this replaced (issue 33): give it a room."""
    modules = [m for m in package_modules() if layer_of(m) == "foundation"]
    outside = [m for m in modules if m not in ROOT_MODULES and m.split(".")[1] not in ROOMS]
    assert outside == [], f"foundation modules in no room of {sorted(ROOMS)}: {outside}"
    assert {room_of(m) for m in modules} == {*ROOMS, "root"}  # every room is found, so none is skipped


def test_the_rooms_import_one_way():
    """ROOMS itself has no loop (so no two rooms import each other, even through a third), and the
    imports found in the code stay inside it (`test_every_import_goes_down_the_layers` names any that
    does not, with its line)."""
    assert import_cycle({room: set(below) for room, below in ROOMS.items()}) is None
    sources = read_sources(package_modules())
    found: dict[str, set[str]] = {}
    for module, (_, text, is_package) in sources.items():
        if layer_of(module) == "foundation":
            for _, imported in imported_modules(module, text, is_package, set(sources)):
                if layer_of(imported) == "foundation" and room_of(imported) not in (room_of(module), "root"):
                    found.setdefault(room_of(module), set()).add(room_of(imported))
    assert import_cycle(found) is None
    assert all(found.get(room, set()) <= below for room, below in ROOMS.items())


def test_no_import_cycles():
    """Not even through a function-level import (the old way round a cycle: `edgefinfer.cli` <->
    `prune/cli.py`); an import under `if TYPE_CHECKING:` never runs, so it may close a loop."""
    assert import_cycle(run_time_graph(read_sources(package_modules()))) is None


def test_the_cycle_finder():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    sources = {"edgefinfer.cli": ("edge/cli.py", "from edgefinfer.prune import cli\n", False),
               "edgefinfer.prune.cli": ("prune/cli.py", "def f():\n    from edgefinfer.cli import x\n", False),
               "edgefinfer.kv": ("edge/kv.py", "if TYPE_CHECKING:\n    from edgefinfer.store import S\n", False),
               "edgefinfer.store": ("edge/store.py", "from edgefinfer.kv import K\n", False)}
    assert import_cycle(run_time_graph(sources)) == ["edgefinfer.cli", "edgefinfer.prune.cli", "edgefinfer.cli"]
    del sources["edgefinfer.prune.cli"]
    assert import_cycle(run_time_graph(sources)) is None  # the TYPE_CHECKING import does not count


def test_no_cli_module_sits_below_the_app():
    """The command line is the app's: a library's click command would import the app back (a cycle)."""
    below = [m for m, p in package_modules().items() if layer_of(m) != "app" and "import click" in p.read_text()]
    assert below == []


# Modules the synthetic sources below may name (a `from x import y` resolves y against them).
KNOWN = {m: (m.replace(".", "/") + ".py", "", False)
         for m in ("edgefinfer.compile.onnx_export", "edgefinfer.app.cli", "edgefinfer.runtime.engine",
                   "edgefinfer.decoding.generation", "edgefinfer.model.checkpoint")}


@pytest.mark.parametrize("module,source,message", [
    ("edgefinfer.model.transformer", "def f():\n    from edgefinfer.runtime.engine import Engine\n",
     "edge/model/transformer.py:2: edgefinfer.model.transformer (foundation) imports edgefinfer.runtime.engine "
     "(runtime); foundation may import only itself"),
    ("edgefinfer.model.config", "from edgefinfer.decoding.generation import stop_token_ids\n",
     "edge/model/config.py:1: edgefinfer.model.config (room model) imports edgefinfer.decoding.generation "
     "(room decoding); model may import only files, tokenization and the root"),
    ("edgefinfer.files.atomic", "def f():\n    from edgefinfer.model import checkpoint\n",
     "edge/files/atomic.py:2: edgefinfer.files.atomic (room files) imports edgefinfer.model.checkpoint "
     "(room model); files may import only itself and the root"),
    ("edgefinfer.compile.qnn", "import numpy\nimport edgefinfer.runtime.engine\n",
     "compile/qnn.py:2: edgefinfer.compile.qnn (compile) imports edgefinfer.runtime.engine (runtime); "
     "compile may import only foundation"),
    ("edgefinfer.runtime.decode", "from ..compile import onnx_export\n",
     "runtime/decode.py:1: edgefinfer.runtime.decode (runtime) imports edgefinfer.compile.onnx_export (compile); "
     "runtime may import only foundation"),
    ("edgefinfer.prune.pipeline", "class A:\n    def m(self):\n        from edgefinfer.app import cli\n",
     "prune/pipeline.py:3: edgefinfer.prune.pipeline (prune) imports edgefinfer.app.cli (app); "
     "prune may import only foundation"),
    ("edgefinfer.server_gpu.api", "from edgefinfer.compile import onnx_export, missing_name\n",
     "server_gpu/api.py:1: edgefinfer.server_gpu.api (server_gpu) imports edgefinfer.compile.onnx_export (compile); "
     "server_gpu may import only foundation, runtime"),
])
def test_the_checker_names_an_import_against_the_layering(module, source, message):
    file = message.split(":")[0]
    assert [str(v) for v in violations({module: (file, source, False), **KNOWN})] == [message]


def test_the_checker_allows_imports_down_and_within_a_layer():
    sources = {
        "edgefinfer.server_gpu.loader": ("server_gpu/loader.py",
                                         "from edgefinfer.runtime.engine import Engine\nfrom . import sampler\n"
                                         "from edgefinfer.errors import UserError\n", False),
        "edgefinfer.distill.student": ("distill/student.py", "from edgefinfer.prune.structured import Kept\n", False),
        "edgefinfer.distill.__main__": ("distill/__main__.py", "from edgefinfer.app.distill_command import main\n",
                                        False),
        "edgefinfer.server_gpu.sampler": ("server_gpu/sampler.py", "", False),
        "edgefinfer.decoding.eager": ("edge/decoding/eager.py", "from edgefinfer.model.transformer import Transformer\n"
                                      "from edgefinfer.decoding import sampling\n", False),
        "edgefinfer.model.transformer": ("edge/model/transformer.py", "", False),
        "edgefinfer.decoding.sampling": ("edge/decoding/sampling.py", "from edgefinfer.errors import UserError\n",
                                         False),
        "edgefinfer.errors": ("edge/errors.py", "", False),
    }
    assert violations(sources) == []
