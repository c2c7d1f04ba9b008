"""Checks the house rules of imports: no circle, and no import from a lower package to a
higher one or across packages on the same floor. Inside a package that has rooms
(``ROOMS``), the same rule holds between its rooms: each room (a sub-package or a
top-level module of the package) imports only rooms on lower sub-floors, and every
module of the package must sit in a listed room.

    python tools/check_layers.py        # exit 1 and a list of offences, or a one-line OK

Every import counts, also one inside a function: a lazy import still ties two packages.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# Bottom up. A package may import its own modules and any package on a lower floor.
FLOORS: list[tuple[str, ...]] = [
    ("wire",),
    ("transport", "engine"),
    ("runtime", "bundled_models"),
    ("prefill", "decode", "detokenizer", "router", "cluster"),
    ("colocated",),
    ("frontend",),
    ("launcher",),
    ("benchmarks",),
]
FLOOR = {pkg: level for level, pkgs in enumerate(FLOORS) for pkg in pkgs}

# Sub-floors inside a package, bottom up, named by the second part of a module's dotted
# name (``frontend.http.app`` is in room ``http``). The package's own ``__init__`` is no
# room: it holds only its docstring.
ROOMS: dict[str, list[tuple[str, ...]]] = {
    # engine: model code below the KV pool, both below the loaders and the CUDA path, the
    # runner (forwards and sampling), the engine's assembly (``build``: what the schedulers
    # are handed), and speculative decoding over it on top.
    "engine": [
        ("errors", "cache", "kernels", "gguf_reader", "direct_attrs"),
        ("config",),
        ("weights", "tokenizer", "sampling"),
        ("model", "kv"),
        ("checkpoint", "cuda"),
        ("runner",),
        ("build",),
        ("speculative",),
    ],
    "frontend": [
        ("settings", "errors"),
        ("engine_link",),
        ("telemetry",),
        ("api",),
        ("http",),
    ],
    # benchmarks: the harness every benchmark imports, then one room per subject.
    "benchmarks": [
        ("harness",),
        ("engine", "transport", "cluster", "serving"),
        ("peers", "goodput", "determinism"),
    ],
    # frontend.api: what handlers share, the internal chat request, then one room per API
    # family (``frontend.api.openai.chat_completions`` is in room ``openai``).
    "frontend.api": [
        ("common",),
        ("chat",),
        ("openai", "anthropic", "native"),
    ],
}
ROOM_FLOOR = {
    pkg: {room: level for level, rooms in enumerate(floors) for room in rooms}
    for pkg, floors in ROOMS.items()
}


def imports_of(path: Path, root: Path) -> set[str]:
    """Every module of ours that ``path`` imports, as a dotted name."""
    tree = ast.parse(path.read_text(), str(path))
    own = ".".join(path.relative_to(root).with_suffix("").parts)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = own.split(".")[: -node.level]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            out.add(module)
            # ``from pkg import mod`` names a module when pkg/mod.py exists.
            for alias in node.names:
                if (root / module.replace(".", "/") / f"{alias.name}.py").exists():
                    out.add(f"{module}.{alias.name}")
    return {m for m in out if m.split(".")[0] in FLOOR}


def module_graph(root: Path) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for pkg in FLOOR:
        for path in sorted((root / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            name = name.removesuffix(".__init__")
            graph[name] = {m for m in imports_of(path, root) if m != name}
    return graph


def layer_offences(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        a = src.split(".")[0]
        for dst in sorted(targets):
            b = dst.split(".")[0]
            if a != b and FLOOR[b] >= FLOOR[a]:
                bad.append(f"{src} imports {dst}: {b} is not below {a}")
            elif a == b:
                bad += room_offence(src, dst)
    return bad


def room_of(module: str, pkg: str) -> str | None:
    """The room of ``module`` inside ``pkg``: ``frontend.http.app`` -> ``http`` in
    ``frontend``; None outside ``pkg`` or for the package itself."""
    parts, top = module.split("."), pkg.split(".")
    if parts[: len(top)] != top or len(parts) <= len(top):
        return None
    return parts[len(top)]


def room_offence(src: str, dst: str) -> list[str]:
    """Imports between two modules that break the order of rooms of any package with rooms
    holding both (``frontend``, then ``frontend.api`` inside it)."""
    bad = []
    for pkg, floors in ROOM_FLOOR.items():
        a, b = room_of(src, pkg), room_of(dst, pkg)
        if a is None or b is None or a == b or b not in floors:
            continue  # an unplaced module is reported once, by unplaced_modules
        if a in floors and floors[b] < floors[a]:
            continue
        bad.append(f"{src} imports {dst}: room {pkg}.{b} is not below {pkg}.{a}")
    return bad


def unplaced_modules(graph: dict[str, set[str]]) -> list[str]:
    """Modules of a package with rooms that sit in no listed room."""
    return [
        f"{name} is in no room of {pkg}: add it to ROOMS in tools/check_layers.py"
        for name in sorted(graph)
        for pkg in ROOMS
        if (room := room_of(name, pkg)) is not None and room not in ROOM_FLOOR[pkg]
    ]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    graph = module_graph(root)
    problems = layer_offences(graph) + unplaced_modules(graph)
    problems += ["import circle: " + " -> ".join(c) for c in circles(graph)]
    for line in problems:
        print(line)
    if problems:
        return 1
    print(f"imports OK: {len(graph)} modules, no circle, every import points down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
