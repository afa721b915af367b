"""tools/largest_cells.py: sizes of code cells, the --max limit and its exit status."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import largest_cells  # noqa: E402


def _nb(path: Path, *cells: tuple[str, str]) -> Path:
    nb = {"cells": [{"cell_type": t, "metadata": {}, "source": s} for t, s in cells], "nbformat": 4}
    path.write_text(json.dumps(nb))
    return path


def test_sizes_labels_and_limit(tmp_path, capsys):
    big = "#| export\nclass Big:\n" + "    x = 1\n" * 9 + "\n\n"  # 11 lines, trailing blanks not counted
    _nb(tmp_path / "01_a.ipynb", ("markdown", "# A\n" * 50), ("code", "#| default_exp a"), ("code", big))
    _nb(tmp_path / "02_b.ipynb", ("code", ["def f():\n", "    return 1\n"]))
    (tmp_path / "03_half.ipynb").write_text('{"cells": [')
    cells = largest_cells.notebook_cells(tmp_path / "01_a.ipynb")
    assert [(c.index, c.lines, c.exported, c.label) for c in cells] == [
        (2, 1, False, ""),  # directives and comments are not a label
        (3, 11, True, "class Big"),
    ]
    assert largest_cells.main([str(tmp_path), "--max", "11"]) == 0
    assert largest_cells.main([str(tmp_path), "--max", "10", "--top", "1"]) == 1
    out, err = capsys.readouterr()
    assert "01_a.ipynb  cell 3  export  class Big" in out and "11 over" in out
    assert "1 code cells have more than 10 lines" in err and "skipped" in err and "03_half" in err


def test_the_repo_notebooks_are_found():
    nbs = largest_cells.find_notebooks(largest_cells.DEFAULT_PATHS)
    assert any(p.parent.name == "kernels" for p in nbs) and any(p.name == "12_block_pool.ipynb" for p in nbs)
