"""Build the docs site: `python tools/docs/build.py [--chapters PAT ...] [--no-execute] [-v]`, `make docs`.

Every chapter is executed on the CPU first (`execute.execute_chapters`: a fresh process each, outputs cached
in `build/docs-cache/`), and the outputs go into a staged copy of the notebook (cleaned by
`chapters.clean_notebook`); the committed notebooks are never written. The staged notebooks, a home page (the
README and one toctree per sidebar section), the API page and the seed-notes page go into a temporary Sphinx
source folder; `sphinx-build -c tools/docs` then renders them with this folder's `conf.py` and `static/`. How
and why: tools/docs/README.md.
"""

from __future__ import annotations

import argparse
import fnmatch
import html
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repo this builder belongs to: the default one to build
if __package__ in (None, ""):  # run as a script: make `tools.docs` importable from the repo root
    sys.path.insert(0, str(REPO))

from tools.docs.api import api_markdown  # noqa: E402
from tools.docs.chapters import (  # noqa: E402
    SECTIONS,
    SUB_PACKAGES,
    Chapter,
    clean_notebook,
    discover_chapters,
    find_repo,
    mermaid_to_html,
)
from tools.docs.execute import Executed, ExecutionFailed, execute_chapters, with_outputs  # noqa: E402
from tools.docs.seeds import (  # noqa: E402
    SeedChapter,
    find_seeds,
    parse_seed_index,
    seed_link_html,
    seed_refs,
    seed_text_page,
)

CONF_DIR = Path(__file__).resolve().parent  # conf.py and static/
DESCRIPTION = (
    "Build minivllm's docs site from the notebooks into _docs/, offline: every chapter is run on the CPU "
    "(outputs cached in build/docs-cache/) and its outputs shown on its page."
)
CACHE_DIR = "build/docs-cache"  # under the repo; build/ is git-ignored

ARCHITECTURE_MERMAID = mermaid_to_html("""```mermaid
flowchart LR
    subgraph FE["front end (engine)"]
        LLM["LLM / AsyncLLM"] --> IP["InputProcessor"]
        OP["OutputProcessor<br>detokenizer"] --> RO(["RequestOutput"])
    end
    subgraph EC["EngineCore (core)"]
        S["Scheduler"] --> KVM["KVCacheManager<br>BlockPool"]
    end
    subgraph W["Executor / Worker (worker)"]
        MR["GPUModelRunner<br>InputBatch"] --> M["model + attention<br>(kernels)"] --> SA["Sampler"]
    end
    IP -->|EngineCoreRequest| S
    S -->|SchedulerOutput| MR
    SA -->|ModelRunnerOutput| S
    S -->|EngineCoreOutputs| OP
```""")


def _toctree(caption: str, entries: list[str]) -> list[str]:
    # :titlesonly: keeps Sphinx from copying every heading of every page into each page's navigation tree
    return ["```{toctree}", f":caption: {caption}", ":maxdepth: 1", ":titlesonly:", "", *entries, "```", ""]


ABOUT_SITE = """## This site

Each chapter below is one notebook of `nbs/`, run top to bottom on the CPU when the site was built: the
printed objects, tables and diagrams under the code are that run's real outputs (the committed notebooks
keep none). To build it yourself, from a clone:

```bash
make docs                   # the whole site into _docs/ (first build ~8 min on 2 cores, then cached)
xdg-open _docs/index.html   # or open the file in any browser: it needs no server, no network
.venv/bin/python tools/docs/build.py --chapters 12_block_pool 34_llama   # just these pages
.venv/bin/python tools/docs/build.py --no-execute   # every page, outputs as saved (none)
```

Outputs are cached in `build/docs-cache/` by each notebook's code, so a rebuild runs only the chapters that
changed (`--rerun` runs them all). A cell that raises fails the build, naming the chapter and the cell.
"Follow one request" runs on the embedded SmolLM2 here (`MINIVLLM_EXAMPLE_MODEL=embedded`, which the build
sets) and on a tiny random checkpoint under `nbdev_test`. How the builder works: `tools/docs/README.md`.
"""


def index_markdown(readme: str, chapters: list[Chapter], have_seeds: bool) -> str:
    "The home page: the README, how to build it, a map of the request path, a toctree per sidebar section."
    parts = [readme.rstrip(), "", ABOUT_SITE, "## Chapters", "", ARCHITECTURE_MERMAID, ""]
    for key, caption in SECTIONS.items():
        stems = [c.stem for c in chapters if c.section == key]
        if stems:
            parts += _toctree(caption, stems)
    parts += _toctree("Reference", ["api", "seed_notes"])
    return "\n".join(parts)


def seed_notes_markdown(
    seed_chapters: list[SeedChapter], cited: dict[SeedChapter, list[Chapter]], seeds_dir: Path | None
) -> str:
    "The seed-notes page: every seed chapter, linked to its text when present, with the chapters citing it."
    lines = [
        "# Seed notes",
        "",
        "minivllm implements what these code-reading notes on vLLM v1 describe (in Japanese; the "
        "chapter titles carry an English gloss). Each row links to the chapter's first line in the "
        "copied text and lists the minivllm chapters that cite it.",
        "",
    ]
    if seeds_dir is None:
        lines += [
            "```{note}",
            "The seed texts were not found when this site was built (looked for "
            "`$MINIVLLM_SEEDS` and `../shared/seeds` beside the repo), so nothing below is linked.",
            "```",
            "",
        ]
    lines += ["| seed chapter | file, line | minivllm chapters |", "|---|---|---|"]
    for sc in seed_chapters:
        t = sc.title.replace("|", "\\|")
        if seeds_dir:
            t = f'<a href="seeds/{Path(sc.file).stem}.html#L{sc.line}">{html.escape(t)}</a>'
        users = ", ".join(f"[{c.stem}]({c.stem}.ipynb)" for c in cited.get(sc, []))
        lines.append(f"| {t} | {sc.file}:{sc.line} | {users} |")
    return "\n".join(lines) + "\n"


def _seed_index(repo: Path, seeds_dir: Path | None) -> list[SeedChapter]:
    "The seed chapters from the seeds' README (also without the texts, when the README is beside the repo)."
    for d in [seeds_dir, repo.parent / "shared" / "seeds"]:
        if d and (d / "README.md").exists():
            return parse_seed_index((d / "README.md").read_text(encoding="utf-8"))
    return []


def select_chapters(chapters: list[Chapter], patterns: list[str] | None) -> list[Chapter]:
    "The chapters whose page name (`12_block_pool`, `kernels_00_reshape_and_cache`) matches a glob pattern."
    if not patterns:
        return chapters
    return [
        c
        for c in chapters
        if any(fnmatch.fnmatch(c.stem, p) or fnmatch.fnmatch(c.path.name, p) for p in patterns)
    ]


def stage_site(
    repo: Path,
    src: Path,
    seeds_dir: Path | None,
    chapters: list[Chapter] | None = None,
    executed: dict[str, Executed] | None = None,
) -> list[Chapter]:
    """Write the Sphinx source tree of the site into `src`; return the chapters it holds (default: all).

    A chapter in `executed` gets those outputs on its page; the others keep those saved in the notebook."""
    chapters = discover_chapters(repo / "nbs") if chapters is None else chapters
    executed = executed or {}
    seed_chapters = _seed_index(repo, seeds_dir)
    src.mkdir(parents=True)
    cited: dict[SeedChapter, list[Chapter]] = {}
    for ch in chapters:
        refs = seed_refs(ch.text, ch.title, seed_chapters)
        for sc, _ in refs:
            cited.setdefault(sc, []).append(ch)
        nb = json.loads(ch.path.read_text(encoding="utf-8"))
        if ch.stem in executed:  # the notebook as it was run (the file may have changed since)
            nb = with_outputs(executed[ch.stem].nb, executed[ch.stem].outputs)
        page = clean_notebook(nb, ch.title, seed_link_html(refs, seeds_dir is not None))
        (src / f"{ch.stem}.ipynb").write_text(json.dumps(page, ensure_ascii=False), encoding="utf-8")
    readme_path = repo / "README.md"
    readme = readme_path.read_text(encoding="utf-8") if readme_path.exists() else "# minivllm\n"
    (src / "index.md").write_text(index_markdown(readme, chapters, seeds_dir is not None), encoding="utf-8")
    subs = {pkg: repo / pkg for pkg in SUB_PACKAGES.values() if (repo / pkg).is_dir()}
    api = api_markdown(repo / "minivllm", chapters, sub_packages=subs)
    (src / "api.md").write_text(api, encoding="utf-8")
    seed_notes = seed_notes_markdown(seed_chapters, cited, seeds_dir)
    (src / "seed_notes.md").write_text(seed_notes, encoding="utf-8")
    return chapters


def write_seed_pages(seeds_dir: Path, out: Path) -> None:
    "One `seeds/<stem>.html` page per seed text, next to the pages Sphinx wrote into `out`."
    (out / "seeds").mkdir()
    for p in sorted(seeds_dir.glob("*.txt")):
        page = seed_text_page(p.name, p.read_text(encoding="utf-8", errors="replace"))
        (out / "seeds" / f"{p.stem}.html").write_text(page, encoding="utf-8")


def _write_manifest(out: Path, chapters: list[Chapter], executed: dict[str, Executed]) -> None:
    """chapters.json: what this build held (other notebooks may appear while it runs), for tests and tools;
    `executed` is null for a page showing saved outputs, else the seconds its run took and whether cached."""
    rows = [
        {
            "stem": c.stem,
            "file": c.path.name,
            "title": c.title,
            "module": c.module,
            "section": c.section,
            "executed": (
                {"seconds": executed[c.stem].seconds, "cached": executed[c.stem].cached}
                if c.stem in executed
                else None
            ),
        }
        for c in chapters
    ]
    (out / "chapters.json").write_text(json.dumps(rows, ensure_ascii=False, indent=1), encoding="utf-8")


def build_site(
    repo: Path | None = None,
    out: Path | None = None,
    seeds: Path | None | bool = True,
    quiet: bool = True,
    chapters: list[str] | None = None,
    execute: bool | list[str] = True,
    cache: Path | None | bool = True,
    rerun: bool = False,
    jobs: int | None = None,
    log=None,
) -> Path:
    """Build the static site from `repo`/nbs into `out` (default `repo/_docs`, replaced) and return `out`.

    `repo`: default, the repo holding this builder. `seeds`: a folder of seed texts, True to look for
    them (`find_seeds`), False for none. `chapters`: glob patterns on page names (`12_block_pool`,
    `3*`, `kernels_*`): only those pages (default: all). `execute`: True runs every chapter of the site
    first and shows its outputs, False none (outputs as saved), a list of patterns only those. `cache`: the
    folder of cached runs (True: `repo/build/docs-cache`, None/False: no cache); `rerun` ignores it; `jobs`
    chapters run at once (default: CPUs + 1, at most 4). `log`: a print-like callable for progress.
    Raises ExecutionFailed when a chapter's cell raises (chapter and cell named), RuntimeError when
    sphinx-build fails (with its output). Warnings go to `_warnings.txt` in the staging folder (printed
    unless `quiet`). Without execution about 20 s of CPU for ~80 notebooks."""
    repo = find_repo(repo or REPO)
    out = Path(out) if out else repo / "_docs"
    log = log or (lambda *a, **k: None)
    seeds_dir = find_seeds(repo) if seeds is True else (Path(seeds) if seeds else None)
    chosen = select_chapters(discover_chapters(repo / "nbs"), chapters)
    executed: dict[str, Executed] = {}
    if execute:
        to_run = chosen if execute is True else select_chapters(chosen, list(execute))
        cache_dir = repo / CACHE_DIR if cache is True else (Path(cache) if cache else None)
        t0 = time.time()
        jobs = jobs or min(4, (os.cpu_count() or 1) + 1)  # +1: many chapters wait on processes they spawn
        executed = execute_chapters(to_run, repo, cache_dir, jobs, rerun, log)
        ran = sorted((e.seconds, s) for s, e in executed.items() if not e.cached)
        if ran:
            slow = ", ".join(f"{s} {t:.0f} s" for t, s in ran[::-1][:5])
            log(f"docs: ran {len(ran)} chapter(s) in {time.time() - t0:.0f} s (slowest: {slow})")
    with tempfile.TemporaryDirectory(prefix="minivllm-docs-") as tmp:
        src = Path(tmp) / "src"
        chosen = stage_site(repo, src, seeds_dir, chosen, executed)
        if out.exists():
            shutil.rmtree(out)
        cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-c", str(CONF_DIR)]
        cmd += ["-d", str(Path(tmp) / "doctrees"), "-w", str(Path(tmp) / "_warnings.txt")]
        cmd += [*(["-q"] if quiet else []), str(src), str(out)]
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        log(f"docs: rendering {len(chosen)} chapter(s) with Sphinx")
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise RuntimeError(
                f"sphinx-build failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
            )
        warnings = (Path(tmp) / "_warnings.txt").read_text(errors="replace")
    if seeds_dir:
        write_seed_pages(seeds_dir, out)
    _write_manifest(out, chosen, executed)
    (out / ".buildinfo").unlink(missing_ok=True)
    if warnings.strip() and not quiet:
        print(warnings)
    return out


def main(argv: list[str] | None = None) -> int:
    "Build the site from the command line (what `make docs` runs); print where it is."
    ap = argparse.ArgumentParser(prog="python tools/docs/build.py", description=DESCRIPTION)
    ap.add_argument("--repo", type=Path, help="the repo to build (default: the one holding this builder)")
    ap.add_argument("--out", type=Path, help="output folder (default: _docs in the repo)")
    ap.add_argument(
        "--seeds", type=Path, help="folder of the seed texts (default: $MINIVLLM_SEEDS or ../shared/seeds)"
    )
    ap.add_argument("--no-seeds", action="store_true", help="build without copying the seed texts")
    ap.add_argument("--chapters", nargs="+", metavar="PAT", help="only these pages (globs: 12_block_pool 3*)")
    ap.add_argument("--no-execute", action="store_true", help="run no notebook: outputs as saved")
    ap.add_argument("--rerun", action="store_true", help="run every chapter again, ignoring the cache")
    ap.add_argument("--cache", type=Path, help=f"folder of cached runs (default: {CACHE_DIR} in the repo)")
    ap.add_argument("--jobs", "-j", type=int, help="chapters run at once (default: CPUs + 1, at most 4)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print Sphinx's progress and warnings")
    a = ap.parse_args(argv)
    t0 = time.time()
    try:
        out = build_site(
            repo=a.repo,
            out=a.out,
            seeds=False if a.no_seeds else (a.seeds or True),
            quiet=not a.verbose,
            chapters=a.chapters,
            execute=not a.no_execute,
            cache=a.cache or True,  # True: build/docs-cache in the repo
            rerun=a.rerun,
            jobs=a.jobs,
            log=lambda *x: print(*x, flush=True),
        )
    except ExecutionFailed as e:
        print(f"docs: build failed: a cell raised in {e}", file=sys.stderr)
        if e.traceback:
            print(e.traceback[-3000:], file=sys.stderr)
        return 1
    print(f"docs: {out / 'index.html'} ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
