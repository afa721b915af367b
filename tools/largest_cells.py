"""Print the largest code cells of the notebooks; with `--max N`, fail when any cell is longer than N lines.

    python tools/largest_cells.py                 # the 20 largest code cells of nbs/ and nbs/kernels/
    python tools/largest_cells.py --top 50 nbs/23_scheduler.ipynb
    python tools/largest_cells.py --max 80        # exit 1 if a cell has more than 80 lines (what CI runs)

A cell's size is its number of source lines, blank lines and `#|` directives included, trailing blank lines
not. Each row names the notebook, the cell's position among the notebook's cells (1-based, as Jupyter shows
them), whether nbdev exports it, and the first class or function it defines, to find it by.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PATHS = [REPO / "nbs", REPO / "nbs" / "kernels"]


@dataclass
class Cell:
    "One code cell: the notebook it is in, its 1-based position among the notebook's cells, size and label."

    path: Path
    index: int
    lines: int
    exported: bool
    label: str


def _source(cell: dict) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def _label(src: str) -> str:
    "The first class the cell defines (`class Scheduler`), else its first function, else its first code line."
    for pattern in (r"^class\s+\w+", r"^(?:async\s+)?def\s+\w+"):
        if m := re.search(pattern, src, re.M):
            return m.group(0)
    code = [line for line in src.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return code[0].strip()[:60] if code else ""


def notebook_cells(path: Path) -> list[Cell]:
    "The code cells of one notebook. Raises ValueError for a file that is not notebook JSON."
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a notebook ({e})") from e
    cells = []
    for i, cell in enumerate(nb.get("cells", []), 1):
        if cell.get("cell_type") != "code":
            continue
        src = _source(cell).rstrip()
        exported = bool(re.search(r"^#\|\s*export", src, re.M))
        cells.append(Cell(path, i, len(src.splitlines()), exported, _label(src)))
    return cells


def find_notebooks(paths: list[Path]) -> list[Path]:
    "The notebooks named, and those directly inside the folders named (checkpoints excluded), sorted."
    found = set()
    for p in paths:
        if p.is_dir():
            found |= {nb for nb in p.glob("*.ipynb") if not nb.name.startswith(".")}
        elif p.suffix == ".ipynb":
            found.add(p)
    return sorted(found)


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    "Print the largest cells; return 1 when `--max` is given and a cell is over it, else 0."
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "paths", nargs="*", type=Path, help="notebooks or folders (default: nbs/ and nbs/kernels/)"
    )
    ap.add_argument("--top", type=int, default=20, help="how many of the largest cells to print (default 20)")
    ap.add_argument("--max", type=int, help="fail (exit 1) if a code cell has more than this many lines")
    a = ap.parse_args(argv)
    cells, unreadable = [], []
    for nb in find_notebooks(a.paths or DEFAULT_PATHS):
        try:
            cells += notebook_cells(nb)
        except ValueError as e:
            unreadable.append(str(e))
    cells.sort(key=lambda c: (-c.lines, _rel(c.path), c.index))
    over = [c for c in cells if a.max is not None and c.lines > a.max]
    shown = cells[: max(a.top, len(over))]  # every cell over the limit, however many
    for c in shown:
        flag = " over" if c in over else ""
        kind = "export" if c.exported else "      "
        print(f"{c.lines:5d}{flag}  {_rel(c.path)}  cell {c.index}  {kind}  {c.label}")
    n_nbs = len({c.path for c in cells})
    print(f"{len(cells)} code cells in {n_nbs} notebooks; largest {cells[0].lines if cells else 0} lines")
    for msg in unreadable:
        print(f"skipped {msg}", file=sys.stderr)
    if over:
        print(
            f"{len(over)} code cells have more than {a.max} lines: split them (prose between)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
