"""The API reference page: every name in each exported module's `__all__`, with its signature and docstring.

Modules are read with `ast`, never imported: the docs build then needs neither torch nor a working engine, a
half-finished module elsewhere cannot break it, and a module that does not exist yet is simply absent.
"""

from __future__ import annotations

import ast
import copy
import gc
from dataclasses import dataclass, field
from pathlib import Path

from tools.docs.chapters import Chapter

# Names that get a quick index at the top of the page, when they exist.
KEY_NAMES = ["LLM", "SamplingParams", "BlockPool", "KVCacheManager", "Scheduler", "EngineCore"]


@dataclass
class ApiEntry:
    "One public name of a module: kind ('class', 'function' or 'value'), signature line, docstring, methods."

    name: str
    kind: str
    signature: str
    doc: str
    members: list[ApiEntry] = field(default_factory=list)


def _args(fn: ast.FunctionDef | ast.AsyncFunctionDef, drop_self: bool) -> str:
    a = copy.copy(fn.args)
    if drop_self:  # self/cls never has a default, so dropping it keeps defaults aligned
        if a.posonlyargs:
            a.posonlyargs = a.posonlyargs[1:]
        elif a.args:
            a.args = a.args[1:]
    ret = f" -> {ast.unparse(fn.returns)}" if fn.returns else ""
    return f"({ast.unparse(a)}){ret}"


def _is_static(fn) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)


def _class_entry(node: ast.ClassDef, name: str) -> ApiEntry:
    "A class: its bases, then `__init__`'s signature or else its public annotated fields, and public methods."
    bases = ", ".join(ast.unparse(b) for b in node.bases + node.keywords)
    sig = f"class {name}" + (f"({bases})" if bases else "")
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init:
        sig += f"\n    __init__{_args(init, True)}"
    else:
        for n in node.body:
            if (
                isinstance(n, ast.AnnAssign)
                and isinstance(n.target, ast.Name)
                and not n.target.id.startswith("_")
            ):
                sig += f"\n    {ast.unparse(n.target)}: {ast.unparse(n.annotation)}"
    members = [
        ApiEntry(n.name, "function", f"{n.name}{_args(n, not _is_static(n))}", ast.get_docstring(n) or "")
        for n in node.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_")
    ]
    return ApiEntry(name, "class", sig, ast.get_docstring(node) or "", members)


def _entry(node: ast.AST, name: str) -> ApiEntry | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        pre = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
        return ApiEntry(name, "function", f"{pre} {name}{_args(node, False)}", ast.get_docstring(node) or "")
    if isinstance(node, ast.ClassDef):
        return _class_entry(node, name)
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        val = ast.unparse(node.value) if node.value is not None else ""
        if len(val) > 120:
            val = val[:120] + "..."
        ann = f": {ast.unparse(node.annotation)}" if isinstance(node, ast.AnnAssign) else ""
        return ApiEntry(name, "value", f"{name}{ann} = {val}", "")
    return None


def parse_module(source: str) -> ast.Module:
    """`ast.parse` with the garbage collector paused. In CPython 3.11 a finalizer that runs Python code in the
    middle of the AST constructor (here: asyncio's "Task was destroyed but it is pending!" for an event loop
    an earlier test closed) makes it raise `SystemError: AST constructor recursion depth mismatch`; it broke
    every docs-site test once in CI. Raises SyntaxError for source that does not parse."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source)
    finally:
        if enabled:
            gc.enable()


def module_api(source: str) -> list[ApiEntry] | None:
    """The documented names of a module's source, in `__all__` order; None when it has no literal `__all__`.

    A name in `__all__` that the module does not define (a re-export) is listed as a value. Raises SyntaxError
    for source that does not parse."""
    names, defs = None, {}
    for node in parse_module(source).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            targets = []
        for t in targets:
            if not isinstance(t, ast.Name):
                continue
            if t.id != "__all__":
                defs[t.id] = node
                continue
            try:
                names = list(ast.literal_eval(node.value))
            except ValueError:
                pass
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
    if names is None:
        return None
    return [_entry(defs[n], n) if n in defs else ApiEntry(n, "value", n, "(re-exported)") for n in names]


def _package_modules(roots: list[tuple[Path, str]]) -> list[tuple[str, list[ApiEntry]]]:
    "(module key, entries) of every module with an `__all__` under each (folder, key prefix) root."
    mods = []
    for root, prefix in roots:
        for p in sorted(root.rglob("*.py")):
            if p.name == "_modidx.py" or "__pycache__" in p.parts:
                continue
            rel = p.relative_to(root).with_suffix("")
            mod = prefix + ".".join(rel.parts)  # nbdev's default_exp for foo/__init__.py is 'foo.__init__'
            try:
                entries = module_api(p.read_text(encoding="utf-8"))
            except SyntaxError:  # a module being rewritten right now
                entries = None
            if entries:
                mods.append((mod, entries))
    return mods


def _label(mod: str, name: str) -> str:
    return f"api-{mod}-{name}".replace(".", "-").replace("_", "-").lower()


def _one_para(doc: str) -> str:
    return " ".join(doc.split("\n\n")[0].split())


def api_markdown(
    lib_path: Path,
    chapters: list[Chapter],
    lib_name: str = "minivllm",
    sub_packages: dict[str, Path] | None = None,
) -> str:
    """The MyST source of the API page for the package at `lib_path` (and each `sub_packages` name -> folder,
    e.g. `{"minivllm_kernels": repo/"minivllm_kernels"}`), modules in chapter order."""
    by_module = {c.module: c for c in chapters if c.module}
    # a module's key is its chapter's `module`: relative to lib_name for the main package, prefixed for others
    roots = [(Path(lib_path), "")] + [(Path(d), f"{name}.") for name, d in (sub_packages or {}).items()]
    mods = _package_modules(roots)
    order = {c.module: i for i, c in enumerate(chapters) if c.module}
    mods.sort(key=lambda m: (order.get(m[0], len(order)), m[0]))
    lines = [
        "# API reference",
        "",
        f"Every public name (each module's `__all__`) of the `{lib_name}` package, with its signature and "
        "docstring, grouped by module in reading order. Each module links to the chapter that builds it.",
        "",
    ]
    key = {}  # name -> the first module defining it, in KEY_NAMES order
    for n in KEY_NAMES:
        key.setdefault(n, next((mod for mod, es in mods if any(e.name == n for e in es)), None))
    key = {n: m for n, m in key.items() if m}
    if key:
        lines += [
            "**Start here:** " + " · ".join(f"{{ref}}`{n} <{_label(m, n)}>`" for n, m in key.items()),
            "",
        ]
    for mod, entries in mods:
        plain = mod.removesuffix(".__init__")
        dotted = plain if mod.split(".")[0] in (sub_packages or {}) else f"{lib_name}.{plain}"
        lines += [f"## `{dotted}`", ""]
        if ch := by_module.get(mod):
            lines += [f"Chapter: [{ch.title}]({ch.stem}.ipynb)", ""]
        for e in entries:
            lines += [f"({_label(mod, e.name)})=", f"### `{e.name}`", "", "```python", e.signature, "```", ""]
            if e.doc:
                lines += [e.doc, ""]
            for m in e.members:
                lines += [f"- `{m.signature.replace('`', '')}`" + (f": {_one_para(m.doc)}" if m.doc else "")]
            if e.members:
                lines.append("")
    return "\n".join(lines) + "\n"
