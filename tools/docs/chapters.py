"""The chapters of the site: which notebooks, in which order and sidebar section, each cleaned for its page.

Every `nbs/*.ipynb` except `index.ipynb` is a chapter, and so is every notebook of a second nbdev package
(`nbs/kernels/`). Reading order is numeric on the leading number, then the letter after it (`30`, `30a`,
`30b`, `31`), so a new notebook is picked up at build time with no list to maintain.
"""

from __future__ import annotations

import html
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

# The sidebar follows the architecture, in the order a request meets the pieces. A chapter's section comes
# from its number and its `default_exp` module path: chapters 00-10 are the shared boundary structures and the
# data-flow walk-through; after that the module path decides (so the scheduler, `v1.core.sched.*`, sits with
# the KV cache in *Core*, wherever it is numbered), and number ranges are the fallback for notebooks that
# export nothing. To add a section or move a family of modules, edit these three tables.
SECTIONS: dict[str, str] = {  # key -> caption, in sidebar order
    "dataflow": "Data flow",
    "core": "Core: scheduler and KV cache",
    "engine": "Engine and front end",
    "worker": "Worker: model runner, sampler, models",
    "kernels": "Kernels and layers",
    "connectors": "Connectors",
    "multimodal": "Multimodal",
    "server": "Server",
    "observe": "Seeing the engine work",
    "appendix": "Appendix",
}

# (first, last, section): checked before the module rules
NUMBER_FIRST: list[tuple[int, int, str]] = [(0, 10, "dataflow")]

# (regex on the dotted module path, section): the first match wins
MODULE_RULES: list[tuple[str, str]] = [
    (r"connector|kv_transfer|ec_transfer", "connectors"),
    (r"multimodal|encoder_cache|vision|siglip|_mm\b", "multimodal"),
    (r"^entrypoints\.(openai|cli|api_server|serve)", "server"),
    (r"^(attention|v1\.attention|minivllm_kernels|model_executor\.layers)(\.|$)", "kernels"),
    (r"^v1\.core(\.|$)", "core"),
    (r"^(v1\.engine|entrypoints|engine|v1\.metrics|transformers_utils)(\.|$)", "engine"),
    (r"^(v1\.worker|v1\.executor|v1\.sample|model_executor|worker|executor)(\.|$)", "worker"),
    (r"^testing$", "appendix"),
]

# (first, last, section): used when no module rule matched
NUMBER_FALLBACK: list[tuple[int, int, str]] = [
    (11, 19, "core"),
    (20, 29, "engine"),
    (30, 39, "worker"),
    (40, 49, "worker"),
    (50, 59, "engine"),
    (60, 69, "observe"),  # step traces, plots, the block pool picture, the simulator
    (70, 79, "multimodal"),
    (80, 89, "server"),
    (90, 99, "appendix"),
]

# folders of nbs/ that are nbdev packages of their own -> their package (lib_name): nbs/kernels -> minivllm_kernels/
SUB_PACKAGES = {"kernels": "minivllm_kernels"}

# The one spelling the notebooks use for a diagram: Quarto's (see "Which fence" in tools/docs/README.md).
DIAGRAM_FENCE = "```{mermaid}"

_NUM = re.compile(r"^(\d+)([a-z]*)_")
_DIRECTIVE = re.compile(r"^\s*#\s*\|\s*([\w-]+)\s*:?\s*(.*?)\s*$")
_MERMAID = re.compile(
    r"^(?P<ind>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*\{?mermaid\}?[ \t]*\n(?P<body>.*?)^[ \t]*(?P=fence)[ \t]*$",
    re.M | re.S,
)


def section_for(number: int | None, module: str | None) -> str:
    "The sidebar section (a key of `SECTIONS`) of a chapter with this leading number and `default_exp`."

    def by_number(table):
        return next((s for lo, hi, s in table if number is not None and lo <= number <= hi), None)

    if sec := by_number(NUMBER_FIRST):
        return sec
    if module:
        for pat, sec in MODULE_RULES:
            if re.search(pat, module):
                return sec
    return by_number(NUMBER_FALLBACK) or "appendix"


@dataclass
class Chapter:
    "One notebook as a page: where it is, its number, title, exported module and sidebar section."

    path: Path
    stem: str
    number: int | None
    suffix: str
    title: str
    module: str | None
    section: str
    text: str = field(repr=False, default="")  # all markdown cells, for the seed-reference scan

    @property
    def sort_key(self) -> tuple:
        return (self.number is None, self.number or 0, self.suffix, self.stem)


def cell_source(cell: dict) -> str:
    "A notebook cell's source as one string (nbformat allows a string or a list of lines)."
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def cell_directives(source: str) -> tuple[dict[str, str], str]:
    "Split nbdev `#| name value` lines off the top of a code cell: ({name: value}, remaining source)."
    lines, dirs, i = source.splitlines(), {}, 0
    while i < len(lines):
        if not lines[i].strip():  # blank lines between directives are allowed
            i += 1
            continue
        m = _DIRECTIVE.match(lines[i])
        if m is None:
            break
        dirs[m.group(1)] = m.group(2)
        i += 1
    return dirs, "\n".join(lines[i:]).strip("\n")


def read_chapter(path: Path, package: str | None = None, folder: str | None = None) -> Chapter:
    """Read a notebook's number, title (its first `# ` heading), `default_exp` module and section.

    `package`: set for a notebook of a second nbdev package (`minivllm_kernels`, exported from the folder
    `nbs/kernels/`, `folder`). Its page is `<folder>_<stem>`, its module `<package>.<default_exp>`, and it has no chapter number (its own
    numbering restarts at 00), so it sorts after the numbered chapters of its section. Raises
    json.JSONDecodeError for a notebook that is not valid JSON."""
    path = Path(path)
    nb = json.loads(path.read_text(encoding="utf-8"))
    m = None if package else _NUM.match(path.stem)
    number, suffix = (int(m.group(1)), m.group(2)) if m else (None, "")
    title, module, md = None, None, []
    for cell in nb.get("cells", []):
        src = cell_source(cell)
        if cell.get("cell_type") == "markdown":
            md.append(src)
            if title is None and (h := re.search(r"^#\s+(.+?)\s*$", src, re.M)):
                title = h.group(1)
        elif cell.get("cell_type") == "code" and module is None:
            module = cell_directives(src)[0].get("default_exp")
    title = title or path.stem
    if package:
        module = f"{package}.{module}" if module else package
    stem = f"{folder or package}_{path.stem}" if package else path.stem
    return Chapter(path, stem, number, suffix, title, module, section_for(number, module), "\n\n".join(md))


def find_repo(start: Path | None = None) -> Path:
    "The repo root: the nearest folder holding settings.ini, from `start` (default: cwd) upwards."
    p = Path(start or Path.cwd()).resolve()
    for d in [p, *p.parents]:
        if (d / "settings.ini").exists():
            return d
    raise FileNotFoundError(f"no settings.ini in {p} or above")


def discover_chapters(nbs_path: Path) -> list[Chapter]:
    """All chapter notebooks under `nbs_path` and its `SUB_PACKAGES` folders (not `index.ipynb`, not
    `_`-prefixed), in reading order. A notebook that is not valid JSON (say, half-written by an editor) is
    left out with a note on stderr."""
    chapters = []
    found = [(p, None, None) for p in Path(nbs_path).glob("*.ipynb")]
    found += [(p, pkg, d) for d, pkg in SUB_PACKAGES.items() for p in (Path(nbs_path) / d).glob("*.ipynb")]
    for p, pkg, folder in found:
        if p.stem == "index" or p.name.startswith(("_", ".")):
            continue
        try:
            chapters.append(read_chapter(p, pkg, folder))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            print(f"docs: skipping {p.name}: {e}", file=sys.stderr)
    return sorted(chapters, key=lambda c: c.sort_key)


def mermaid_to_html(markdown: str) -> str:
    """Replace each ```mermaid (or ```{mermaid}) fence in `markdown` with a `<pre class="mermaid">` block.

    The block is a CommonMark type 1 HTML block, which runs to the closing `</pre>` even across blank lines,
    so the markdown parser leaves the (HTML-escaped) diagram alone; mermaid reads the element's text in the
    browser. Quarto's `%%|` option lines are dropped."""

    def repl(m):
        body = "\n".join(line for line in m.group("body").splitlines() if not line.lstrip().startswith("%%|"))
        return f'<pre class="mermaid">\n{html.escape(body.strip(), quote=False)}\n</pre>'

    return _MERMAID.sub(repl, markdown)


def _clean_code_cell(cell: dict, src: str) -> dict | None:
    "The page's copy of a code cell: directives removed and turned into myst-nb tags; None to drop it."
    dirs, src = cell_directives(src)
    if "hide" in dirs or not (src.strip() or cell.get("outputs")):
        return None  # `#| hide`, and cells holding only directives (`#| default_exp`)
    tags = list(cell.get("metadata", {}).get("tags", []))
    if dirs.get("echo") == "false":
        tags.append("remove-input")
    if dirs.get("output") == "false":
        tags.append("remove-output")
    return {**cell, "source": src, "metadata": {"tags": tags} if tags else {}}


def clean_notebook(nb: dict, title: str = "", seed_html: str = "") -> dict:
    """A copy of notebook dict `nb` ready for myst-nb, as nbdev's own processors would leave it.

    `#|` lines are removed from code cells, `#| hide` cells dropped, `#| echo: false` / `#| output: false`
    become myst-nb's `remove-input` / `remove-output` tags, diagrams become `<pre class="mermaid">`, and
    `seed_html` goes under the title and its `> summary`. Saved outputs are kept. A notebook without a `# `
    heading gets one from `title`."""
    cells, titled = [], False
    for cell in nb.get("cells", []):
        src = cell_source(cell)
        if cell.get("cell_type") == "code":
            cell = _clean_code_cell(cell, src)
            if cell is None:
                continue
        elif cell.get("cell_type") == "markdown":
            if _DIRECTIVE.match(src.split("\n", 1)[0]) and "hide" in cell_directives(src)[0]:
                continue
            src = mermaid_to_html(src)
            if not titled and (h := re.search(r"^#\s+.+$", src, re.M)):
                titled = True
                src = _insert_after_summary(src, h.end(), seed_html)
            cell = {**cell, "source": src, "metadata": {}}
        else:
            cell = {**cell, "source": src}
        cell["id"] = f"cell-{len(cells)}"  # nbformat 4.5 wants ids; nbdev_clean may have dropped them
        cells.append(cell)
    if not titled:
        source = f"# {title or 'Untitled'}\n\n{seed_html}\n".rstrip() + "\n"
        cells.insert(0, {"cell_type": "markdown", "metadata": {}, "id": "cell-title", "source": source})
    meta = {
        "kernelspec": {"display_name": "python3", "language": "python", "name": "python3"},
        "language_info": {"name": "python", "pygments_lexer": "ipython3"},
    }
    return {"cells": cells, "metadata": meta, "nbformat": 4, "nbformat_minor": 5}


def _insert_after_summary(src: str, pos: int, block: str) -> str:
    "Put `block` after the H1 ending at `pos` and the nbdev `> summary` lines that follow it."
    if not block:
        return src
    m = re.match(r"(\s*\n(?:[ \t]*>.*\n?)+)?", src[pos:])
    cut = pos + (m.end() if m else 0)
    return f"{src[:cut].rstrip()}\n\n{block}\n\n{src[cut:].lstrip()}"
