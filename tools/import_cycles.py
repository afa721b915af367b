"""Report import cycles between minivllm's modules (module-level imports only; imports inside functions are
how a module breaks a cycle on purpose, so they are not counted).

    python tools/import_cycles.py        # prints each cycle; exit status 1 if there is one
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "minivllm"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    "The absolute module a `from ... import` names."
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path, modules: set[str]) -> set[str]:
    "minivllm modules imported at module level (a `from pkg import name` counts `pkg.name` if it is a module)."
    me = module_name(path)
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            target = resolve(me, is_pkg, node)
            found.add(target)
            found |= {f"{target}.{a.name}" for a in node.names}
    return {m for m in found if m in modules and m != me}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    "Strongly connected components with more than one module (Tarjan)."
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    paths = sorted((ROOT / PKG).rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports_of(p, modules) for p in paths}
    # a package's __init__ is imported with any of its submodules; count only explicit edges
    cycles = find_cycles(graph)
    for comp in cycles:
        print("cycle:", " <-> ".join(comp))
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} module-level imports, {len(cycles)} cycles")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
