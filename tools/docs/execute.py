"""Run the chapters for the site: each notebook on the CPU in a fresh process, outputs cached by hash.

`execute_chapters` runs every chapter as `nbdev_test` would (execnb's `CaptureShell`, in the notebook's own
folder, `#| eval: false` cells skipped), except that `#| slow` cells run too, unless a chapter is listed in
`SKIP_SLOW`. The outputs go into the staged copy of the notebook that Sphinx renders; the committed notebooks
are never written. A cell that raises fails the build: `ExecutionFailed` names the chapter, the cell (its
index among the notebook's cells, as `nbdev_test` counts them) and its source.

The cache (default `build/docs-cache/`, git-ignored) holds one JSON file per chapter and key; the key hashes
the notebook's code cells, the environment knobs below and `CACHE_VERSION`, not the package it imports. So a
change to a chapter re-runs that chapter only; a change elsewhere in the package that alters a chapter's
printed values shows after `--rerun` (or deleting the folder). How and why: tools/docs/README.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as the worker script: import `tools.docs` from the repo root, and keep
    # this folder (api.py, build.py, conf.py...) off sys.path, where a notebook's imports could find them
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from tools.docs.chapters import Chapter, cell_directives, cell_source  # noqa: E402

CACHE_VERSION = "1"  # bump when what an execution records changes

# The environment every chapter runs in. TRITON_INTERPRET=1 as `make test` sets it (the Triton kernels run
# interpreted on the CPU); MINIVLLM_EXAMPLE_MODEL=embedded makes the chapters that can pick a model (00)
# use the embedded SmolLM2 instead of a tiny random checkpoint. These values are part of the cache key.
EXEC_ENV: dict[str, str] = {"TRITON_INTERPRET": "1", "MINIVLLM_EXAMPLE_MODEL": "embedded"}

# Chapters whose `#| slow` cells the site leaves out (none today; a chapter whose slow cells take minutes
# belongs here). Their pages show those cells without outputs.
SKIP_SLOW: set[str] = set()

CELL_TIMEOUT_S = 600  # one cell; a cell that takes longer fails the build, named


@dataclass(eq=False)  # compared and hashed by identity, as exceptions are
class ExecutionFailed(Exception):
    "A chapter's cell raised while the docs build ran it (or its process died)."

    chapter: str  # the notebook, relative to the repo
    cell: int | None  # index in the notebook's cells (nbdev_test's "Cell #" is this plus one)
    source: str = ""
    error: str = ""  # "ZeroDivisionError: division by zero"
    traceback: str = field(default="", repr=False)

    def __str__(self) -> str:
        where = f"cell {self.cell}" if self.cell is not None else "before any cell ran"
        src = "\n".join("    " + line for line in self.source.splitlines()[:12])
        return f"{self.chapter}, {where}: {self.error}" + (f"\n{src}" if src else "")


@dataclass
class Executed:
    "One chapter's run: the notebook as run, outputs by cell index, seconds it took, whether it was cached."

    nb: dict = field(repr=False)
    outputs: dict[int, list] = field(repr=False)
    seconds: float = 0.0
    cached: bool = False


def _skips(cell: dict, skip_flags: set[str]) -> bool:
    "Whether the docs run leaves this cell out (as `nbdev_test` does: markdown, eval: false, skipped flags)."
    if cell.get("cell_type") != "code":
        return True
    src = cell_source(cell)
    if "nbdev_export" + "(" in src:
        return True
    dirs, _ = cell_directives(src)
    return dirs.get("eval", "").lower() == "false" or bool(skip_flags & dirs.keys())


def cache_key(nb: dict, skip_flags: set[str], env: dict[str, str]) -> str:
    "Hash of what decides a chapter's outputs here: its code cells (in order), the skipped flags, the env."
    h = hashlib.sha256(f"minivllm-docs-exec {CACHE_VERSION}\n".encode())
    h.update(json.dumps([sorted(skip_flags), sorted(env.items())]).encode())
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            h.update(b"\0cell\0" + cell_source(cell).encode())
    return h.hexdigest()[:20]


def run_notebook(nb_path: Path, folder: Path, skip_flags: set[str]) -> dict:
    """Execute notebook `nb_path` in this process as `nbdev_test` does, in `folder` (the chapter's own, also
    put on sys.path); return {"outputs": {index: [...]}} or, when a cell raises, {"outputs": ...,
    "error": {"cell", "source", "error", "traceback"}}."""
    from execnb.nbio import read_nb
    from execnb.shell import CaptureShell

    os.environ.pop("IN_TEST", None)  # a page, not a test run
    nb = read_nb(Path(nb_path))
    shell = CaptureShell(Path(folder), timeout=CELL_TIMEOUT_S)
    os.chdir(folder)
    outputs: dict[int, list] = {}
    for i, cell in enumerate(nb.cells):
        if _skips(cell, skip_flags):
            continue
        shell.cell(cell)
        outs = [dict(o) for o in cell.get("outputs", [])]
        outputs[i] = json.loads(json.dumps(outs, default=str))
        if shell.exc:
            e = shell.exc
            tb = "".join(__import__("traceback").format_exception(type(e), e, e.__traceback__))
            err = {"cell": i, "source": cell.source, "error": f"{type(e).__name__}: {e}", "traceback": tb}
            return {"outputs": outputs, "error": err}
    return {"outputs": outputs}


def _worker_env(jobs: int) -> dict[str, str]:
    env = {**os.environ, **EXEC_ENV}  # warnings shown as nbdev_test shows them
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, jobs))))
    return env


def _run_in_subprocess(ch: Chapter, nb: dict, skip_flags: set[str], jobs: int) -> dict:
    "Run notebook `nb` of chapter `ch` in a fresh Python process (no state leaks between chapters)."
    with tempfile.TemporaryDirectory(prefix="minivllm-exec-") as tmp:
        out, copy = Path(tmp) / "result.json", Path(tmp) / ch.path.name
        copy.write_text(json.dumps(nb), encoding="utf-8")  # what was hashed, whatever the file holds by now
        cmd = [sys.executable, str(Path(__file__).resolve()), str(copy), str(ch.path.parent), str(out)]
        cmd += sorted(skip_flags)
        r = subprocess.run(cmd, capture_output=True, text=True, env=_worker_env(jobs), cwd=ch.path.parent)
        if r.returncode != 0 or not out.exists():
            tail = (r.stderr or r.stdout)[-3000:]
            return {
                "outputs": {},
                "error": {
                    "cell": None,
                    "error": f"the process exited {r.returncode}",
                    "traceback": tail,
                    "source": tail,
                },
            }
        return json.loads(out.read_text(encoding="utf-8"))


def execute_chapters(
    chapters: list[Chapter],
    repo: Path,
    cache_dir: Path | None,
    jobs: int = 2,
    rerun: bool = False,
    log=print,
) -> dict[str, Executed]:
    """Run `chapters` (`jobs` at a time, each in its own process) or take their outputs from `cache_dir`.

    Returns {stem: Executed}. `cache_dir` None: no cache; `rerun`: ignore what is cached (and replace it).
    Raises ExecutionFailed for the first failing chapter in reading order, after every chapter has run (the
    others are cached, so the next build runs only what failed); the message lists all of them."""
    results: dict[str, Executed] = {}
    todo: list[tuple[Chapter, dict, set[str], str]] = []
    for ch in chapters:
        nb = json.loads(ch.path.read_text(encoding="utf-8"))
        flags = {"slow"} if ch.stem in SKIP_SLOW else set()
        key = cache_key(nb, flags, EXEC_ENV)
        hit = cache_dir / f"{ch.stem}-{key}.json" if cache_dir else None
        if hit and hit.exists() and not rerun:
            data = json.loads(hit.read_text(encoding="utf-8"))
            outputs = {int(k): v for k, v in data["outputs"].items()}
            results[ch.stem] = Executed(nb, outputs, data["seconds"], True)
        else:
            todo.append((ch, nb, flags, key))

    def run(item):
        ch, nb, flags, key = item
        t0 = time.time()
        res = _run_in_subprocess(ch, nb, flags, jobs)
        res["seconds"] = round(time.time() - t0, 2)
        return ch, nb, key, res

    failures: list[ExecutionFailed] = []
    if todo:
        log(f"docs: executing {len(todo)} chapter(s), {jobs} at a time ({len(results)} cached)")
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for ch, nb, key, res in pool.map(run, todo):
            rel = ch.path.relative_to(repo) if ch.path.is_relative_to(repo) else ch.path
            if "error" in res:
                e = res["error"]
                failures.append(ExecutionFailed(str(rel), e["cell"], e["source"], e["error"], e["traceback"]))
                log(f"docs:   {rel} FAILED ({res['seconds']:.1f} s)")
                continue
            log(f"docs:   {rel} ({res['seconds']:.1f} s)")
            results[ch.stem] = Executed(nb, {int(k): v for k, v in res["outputs"].items()}, res["seconds"])
            if cache_dir:
                cache_dir.mkdir(parents=True, exist_ok=True)
                for old in cache_dir.glob(f"{ch.stem}-*.json"):  # one entry per chapter: drop stale ones
                    old.unlink(missing_ok=True)
                tmp = cache_dir / f".{ch.stem}-{key}.json.tmp"
                tmp.write_text(json.dumps(res, ensure_ascii=False), encoding="utf-8")
                tmp.replace(cache_dir / f"{ch.stem}-{key}.json")
    if failures:
        order = {
            str(c.path.relative_to(repo)) if c.path.is_relative_to(repo) else str(c.path): i
            for i, c in enumerate(chapters)
        }
        failures.sort(key=lambda f: order.get(f.chapter, 0))
        first = failures[0]
        if len(failures) > 1:
            first.error += (
                "\n(also failed: " + ", ".join(f"{f.chapter} cell {f.cell}" for f in failures[1:]) + ")"
            )
        raise first
    return results


def with_outputs(nb: dict, outputs: dict[int, list]) -> dict:
    "A copy of notebook `nb` whose code cells carry `outputs` (by cell index); cells not run get none."
    cells = []
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") == "code":
            outs = outputs.get(i, [])
            n = next((o.get("execution_count") for o in outs if o.get("execution_count")), None)
            cell = {**cell, "outputs": outs, "execution_count": n}
        cells.append(cell)
    return {**nb, "cells": cells}


if __name__ == "__main__":  # the worker: python execute.py NOTEBOOK FOLDER RESULT.json [SKIP_FLAG ...]
    nb_file, folder, result_file, *skip = sys.argv[1:]
    result = run_notebook(Path(nb_file), Path(folder), set(skip))
    Path(result_file).write_text(json.dumps(result, ensure_ascii=False), encoding="utf-8")
