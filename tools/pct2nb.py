"""Convert percent-format scripts (`# %%` cells) into clean nbdev notebooks, or back.

Authoring aid only: the notebooks in nbs/ stay the source of truth.
    python tools/pct2nb.py draft.py nbs/12_block_pool.ipynb     # script -> notebook
    python tools/pct2nb.py nbs/12_block_pool.ipynb draft.py     # notebook -> script (to edit)
"""
import json
import sys

import jupytext

KERNEL = {"kernelspec": {"display_name": "python3", "language": "python", "name": "python3"}}

def main(src: str, dst: str) -> None:
    if src.endswith(".py"):
        nb = jupytext.read(src, fmt="py:percent")
        nb.metadata = dict(KERNEL)
        jupytext.write(nb, dst, fmt="ipynb")
        d = json.load(open(dst))
        d["metadata"] = dict(KERNEL)
        json.dump(d, open(dst, "w"), indent=1, ensure_ascii=False)
        open(dst, "a").write("\n")
    else:
        jupytext.write(jupytext.read(src), dst, fmt="py:percent")

if __name__ == "__main__":
    main(*sys.argv[1:3])
