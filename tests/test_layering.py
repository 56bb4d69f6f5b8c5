"""The import graph of every first-party package, checked with the stdlib `ast` (no imports run):

(a) no import cycle among the modules of a package;
(b) no worker module imports a layer above its own (WORKER_LAYERS, lowest first);
(c) across packages: minisgl_core imports no service; a service imports no other service; only the
    app package (`minisgl`: launcher, shell, LLM) imports services, and nothing imports the app;
    minisgl_core, the gateway, the tokenizer and the scheduler import no torch;
(d) the gateway's rooms (GATEWAY_ROOMS): api/ may import upstream/ and agent/; upstream/ imports
    neither api/ nor agent/; agent/ (pure text parsing) imports nothing of the gateway outside
    itself; no room imports the process wiring (server, __main__).

Every import counts: module level (TYPE_CHECKING blocks included) and inside functions. Importing
`a.b.c` does not count as importing the packages `a` and `a.b` (Python runs their __init__, but an
edge to every parent package would make each package a cycle with its own modules).
Packages are found from the repo's pyproject.toml files, so a moved package is still checked.

    pytest tests/test_layering.py
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".venv", "node_modules", ".git", "build", "dist", "tests", "bench"}

CORE, APP = "minisgl_core", "minisgl"
TORCH_FREE = {"minisgl_core", "minisgl_gateway", "minisgl_tokenizer", "minisgl_scheduler"}
TORCH_NAMES = {"torch", "triton", "flashinfer"}

# The worker's floor plan, lowest layer first: a module may import its own layer and those below.
# A module belongs to the longest listed prefix that names it (a prefix covers its submodules; the
# bare package name covers only its own __init__). An unlisted module fails the test.
WORKER_LAYERS: list[tuple[str, list[str]]] = [
    # switches, configs, the fp8 format, torch.distributed plumbing (the layers' collectives and
    # rank 0's TPGroup, which spawns a module it is given by name): no model knowledge
    ("foundation", ["minisgl_worker", "minisgl_worker.env", "minisgl_worker.config",
                    "minisgl_worker.model_config", "minisgl_worker.gemma3_config",
                    "minisgl_worker.prequant", "minisgl_worker.fp8", "minisgl_worker.fp8_block",
                    "minisgl_worker.quant", "minisgl_worker.distributed"]),
    ("kernels", ["minisgl_worker.kernels"]),  # every @triton.jit and its launcher
    # per-slot sampling state, the plan, the draw, logit bias, grammar masks, the TP draw: reads
    # logits and slots, knows no model
    ("sampling", ["minisgl_worker.sampling"]),
    # the backends and the paged KV cache they read and write; layers call a backend
    ("attention", ["minisgl_worker.attention"]),
    ("layers", ["minisgl_worker.layers"]),  # nn modules
    ("models", ["minisgl_worker.models"]),
    ("loading", ["minisgl_worker.loader", "minisgl_worker.quantize",
                 "minisgl_worker.prequant_load", "minisgl_worker.quant_load"]),
    # Engine, ModelRunner, TP followers, plan building, CUDA graphs
    ("engine", ["minisgl_worker.engine"]),
    ("service", ["minisgl_worker.server", "minisgl_worker.convert", "minisgl_worker.step_trace",
                 "minisgl_worker.__main__"]),
]


@dataclass
class Package:
    name: str
    root: Path  # the package directory
    is_service: bool
    modules: dict[str, Path] = field(default_factory=dict)  # dotted name -> file


def find_packages(repo: Path = ROOT) -> dict[str, Package]:
    packages: dict[str, Package] = {}
    for toml in repo.rglob("pyproject.toml"):
        rel = toml.relative_to(repo)
        # Hidden folders hold local copies (an exported older tree for A/B runs), not packages.
        if (toml.parent == repo or SKIP_DIRS.intersection(rel.parts)
                or any(part.startswith(".") for part in rel.parts)):
            continue
        for init in sorted(toml.parent.glob("*/__init__.py")):
            pkg = Package(init.parent.name, init.parent, "services" in rel.parts)
            for py in sorted(init.parent.rglob("*.py")):
                parts = py.relative_to(init.parent.parent).with_suffix("").parts
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                pkg.modules[name] = py
            packages[pkg.name] = pkg
    return packages


def imports_of(module: str, path: Path, known: set[str]) -> Iterator[str]:
    """Dotted names `module` imports: first-party ones resolved to a known module (or the
    package a name is taken from), others as written."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield sub if sub in known else base


@dataclass
class Graph:
    packages: dict[str, Package]
    edges: dict[str, set[str]]  # first-party module -> first-party modules it imports
    external: dict[str, set[str]]  # first-party module -> top-level names of other imports
    owner: dict[str, str]  # module -> package name


def build_graph(packages: dict[str, Package]) -> Graph:
    known = {m for p in packages.values() for m in p.modules}
    owner = {m: p.name for p in packages.values() for m in p.modules}
    edges: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for pkg in packages.values():
        for module, path in pkg.modules.items():
            edges[module], external[module] = set(), set()
            for target in imports_of(module, path, known):
                top = target.split(".")[0]
                if top in packages:
                    # an unknown submodule of ours (a name from a package): its nearest module
                    while target not in known and "." in target:
                        target = target.rpartition(".")[0]
                    if target != module:
                        edges[module].add(target)
                else:
                    external[module].add(top)
    return Graph(packages, edges, external, owner)


def find_cycle(nodes: set[str], edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among `nodes` (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(edges.get(n, ())):
            if m not in nodes:
                continue
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(nodes):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def worker_layer(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer index)
    for i, (_, prefixes) in enumerate(WORKER_LAYERS):
        for p in prefixes:
            covers = module == p or (p != "minisgl_worker" and module.startswith(p + "."))
            if covers and (best is None or len(p) > best[0]):
                best = (len(p), i)
    return None if best is None else best[1]


def layer_violations(graph: Graph) -> list[str]:
    problems = []
    for module in sorted(graph.packages["minisgl_worker"].modules):
        mine = worker_layer(module)
        if mine is None:
            problems.append(f"{module} has no layer: add it to WORKER_LAYERS in {__file__}")
            continue
        for target in sorted(graph.edges[module]):
            theirs = worker_layer(target) if graph.owner[target] == "minisgl_worker" else None
            if theirs is not None and theirs > mine:
                problems.append(f"{module} ({WORKER_LAYERS[mine][0]}) imports {target} "
                                f"({WORKER_LAYERS[theirs][0]}), a layer above it")
    return problems


def package_violations(graph: Graph) -> list[str]:
    problems = []
    for module, targets in sorted(graph.edges.items()):
        src = graph.packages[graph.owner[module]]
        for target in sorted(targets):
            dst = graph.packages[graph.owner[target]]
            if dst.name == src.name:
                continue
            if dst.name == APP:
                problems.append(f"{module} imports the app package ({target}): nothing may")
            elif dst.is_service and src.name != APP:
                problems.append(f"{module} imports the service {dst.name} ({target}): only the "
                                f"app package {APP!r} may import services")
        if src.name in TORCH_FREE:
            for name in sorted(graph.external[module] & TORCH_NAMES):
                problems.append(f"{module} imports {name}: {src.name} must stay torch-free")
    return problems


# The gateway's rooms: for each, the gateway modules it must never import (a prefix covers its
# submodules). The modules at the package top are the process itself (config, gateway, server,
# metrics, errors, request context); api/ is free to use what it needs below the process wiring.
GATEWAY_ROOMS: dict[str, tuple[str, ...]] = {
    "minisgl_gateway.api": ("minisgl_gateway.server", "minisgl_gateway.__main__"),
    "minisgl_gateway.upstream": ("minisgl_gateway.api", "minisgl_gateway.agent",
                                 "minisgl_gateway.gateway", "minisgl_gateway.server",
                                 "minisgl_gateway.__main__"),
    # pure text parsing: only its own modules
    "minisgl_gateway.agent": ("minisgl_gateway",),
}


def _covers(prefix: str, module: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def gateway_room_violations(graph: Graph) -> list[str]:
    problems = []
    for module in sorted(graph.packages["minisgl_gateway"].modules):
        for room, forbidden in GATEWAY_ROOMS.items():
            if not _covers(room, module):
                continue
            for target in sorted(graph.edges[module]):
                if _covers(room, target):
                    continue
                if any(_covers(f, target) for f in forbidden):
                    problems.append(f"{module} imports {target}: {room.rpartition('.')[2]}/ "
                                    f"must not (GATEWAY_ROOMS)")
    return problems


@pytest.fixture(scope="module")
def graph() -> Graph:
    packages = find_packages()
    assert {CORE, APP, "minisgl_worker", "minisgl_scheduler"} <= set(packages), packages.keys()
    return build_graph(packages)


def test_no_import_cycles(graph: Graph) -> None:
    cycles = []
    for pkg in graph.packages.values():
        cycle = find_cycle(set(pkg.modules), graph.edges)
        if cycle:
            cycles.append(f"{pkg.name}: " + " -> ".join(cycle))
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_worker_modules_import_only_their_layer_and_below(graph: Graph) -> None:
    problems = layer_violations(graph)
    assert not problems, "worker layering:\n  " + "\n  ".join(problems)


def test_packages_import_only_what_their_kind_may(graph: Graph) -> None:
    problems = package_violations(graph)
    assert not problems, "package boundaries:\n  " + "\n  ".join(problems)


def test_gateway_rooms_import_only_what_they_may(graph: Graph) -> None:
    rooms = {m.split(".")[1] for m in graph.packages["minisgl_gateway"].modules if m.count(".") > 1}
    assert {"api", "agent", "upstream"} <= rooms, rooms
    problems = gateway_room_violations(graph)
    assert not problems, "gateway rooms:\n  " + "\n  ".join(problems)


def test_the_gateway_room_check_catches_a_violation(tmp_path: Path) -> None:
    def write(rel: str, text: str = "") -> None:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    base = "services/gateway/minisgl_gateway"
    write("services/gateway/pyproject.toml")
    write(f"{base}/__init__.py")
    write(f"{base}/errors.py")
    for room in ("api", "agent", "upstream"):
        write(f"{base}/{room}/__init__.py")
    write(f"{base}/api/http_app.py", "from minisgl_gateway.upstream import pipeline\n")
    write(f"{base}/upstream/pipeline.py",
          "from minisgl_gateway.errors import x\nfrom minisgl_gateway.api.http_app import y\n")
    write(f"{base}/agent/hermes.py", "def f():\n    from ..errors import x\n")
    g = build_graph(find_packages(tmp_path))
    assert gateway_room_violations(g) == [
        "minisgl_gateway.agent.hermes imports minisgl_gateway.errors: agent/ must not "
        "(GATEWAY_ROOMS)",
        "minisgl_gateway.upstream.pipeline imports minisgl_gateway.api.http_app: upstream/ must "
        "not (GATEWAY_ROOMS)"]


def test_the_checks_catch_a_violation(tmp_path: Path) -> None:
    """A cycle, an upward import and a torch import in a torch-free service, in a fake repo:
    each is reported (so the checks above can fail)."""
    def write(rel: str, text: str = "") -> None:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    write("services/worker/pyproject.toml")
    write("services/worker/minisgl_worker/__init__.py")
    write("services/worker/minisgl_worker/kernels/__init__.py")
    write("services/worker/minisgl_worker/kernels/k.py", "from ..engine import e\n")
    write("services/worker/minisgl_worker/engine/__init__.py")
    write("services/worker/minisgl_worker/engine/e.py",
          "def f():\n    from ..kernels import k\n")
    write("services/scheduler/pyproject.toml")
    write("services/scheduler/minisgl_scheduler/__init__.py",
          "import torch\nfrom minisgl_worker.engine import e\n")
    g = build_graph(find_packages(tmp_path))
    assert find_cycle(set(g.packages["minisgl_worker"].modules), g.edges) == [
        "minisgl_worker.engine.e", "minisgl_worker.kernels.k", "minisgl_worker.engine.e"]
    assert layer_violations(g) == [
        "minisgl_worker.kernels.k (kernels) imports minisgl_worker.engine.e (engine), "
        "a layer above it"]
    assert package_violations(g) == [
        "minisgl_scheduler imports the service minisgl_worker (minisgl_worker.engine.e): "
        "only the app package 'minisgl' may import services",
        "minisgl_scheduler imports torch: minisgl_scheduler must stay torch-free"]


def test_a_tp_follower_never_imports_the_engine(graph: Graph) -> None:
    """Ranks 1..N-1 build a ModelRunner; the Engine (rank 0, which starts them) stays out."""
    seen, todo = set(), ["minisgl_worker.engine.follower"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.edges.get(m, ()))
    assert "minisgl_worker.engine.runner" in seen
    assert "minisgl_worker.engine.engine" not in seen
