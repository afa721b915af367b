"""The docs site builder's pieces (tools/docs/): chapters, cleaning, seed links, the API and home pages.
The full build and the browser check are in test_docs_site.py."""

import contextlib
import io
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `tools.docs` is not installed: import it from the repo root

from tools.docs.api import api_markdown, module_api  # noqa: E402
from tools.docs.build import index_markdown  # noqa: E402
from tools.docs.chapters import (  # noqa: E402
    _NUM,
    MODULE_RULES,
    NUMBER_FALLBACK,
    NUMBER_FIRST,
    SECTIONS,
    Chapter,
    cell_directives,
    clean_notebook,
    discover_chapters,
    mermaid_to_html,
    section_for,
)
from tools.docs.seeds import SeedChapter, parse_seed_index, seed_link_html, seed_refs, seed_text_page  # noqa: E402


def test_sections():
    assert section_for(0, None) == "dataflow"
    assert section_for(6, "v1.core.sched.output") == "dataflow"  # a boundary struct, wherever it lives
    assert section_for(23, "v1.core.sched.scheduler") == "core"  # the scheduler sits with the KV cache
    assert section_for(12, "v1.core.block_pool") == "core"
    assert section_for(51, "v1.engine.async_llm") == "engine"
    assert section_for(29, "entrypoints.llm") == "engine"
    assert section_for(80, "entrypoints.openai.api_server") == "server"
    assert section_for(30, "model_executor.layers.layernorm") == "kernels"
    assert section_for(33, "model_executor.models.llama") == "worker"
    assert section_for(32, "attention.layer") == "kernels"
    assert (
        section_for(36, "transformers_utils.tokenizer") == "engine"
    )  # the front end tokenizes and detokenizes
    assert section_for(60, "distributed.kv_transfer.kv_connector.v1.base") == "connectors"
    assert section_for(44, None) == "worker"
    assert section_for(38, "testing") == "appendix"
    assert section_for(95, None) == "appendix"
    assert section_for(None, None) == "appendix"
    assert all(s in SECTIONS for _, s in MODULE_RULES + [(0, s) for *_, s in NUMBER_FIRST + NUMBER_FALLBACK])


def test_cell_directives():
    src = "#| export\n#|eval: false\n\nx = 1\n#| not a directive any more"
    assert cell_directives(src) == ({"export": "", "eval": "false"}, "x = 1\n#| not a directive any more")
    assert cell_directives("#| default_exp v1.core.block_pool") == ({"default_exp": "v1.core.block_pool"}, "")
    assert cell_directives("x = 1") == ({}, "x = 1")


def _ch(stem):
    m = _NUM.match(stem)
    return Chapter(Path(stem), stem, int(m.group(1)) if m else None, m.group(2) if m else "", stem, None, "")


def test_reading_order():
    stems = ["31_c", "notes", "30b_b", "100_x", "30_a", "30a_z", "00_intro"]
    got = [c.stem for c in sorted(map(_ch, stems), key=lambda c: c.sort_key)]
    assert got == ["00_intro", "30_a", "30a_z", "30b_b", "31_c", "100_x", "notes"]


def test_half_written_notebook_is_skipped():
    with tempfile.TemporaryDirectory() as d, contextlib.redirect_stderr(io.StringIO()) as err:
        Path(d, "01_ok.ipynb").write_text(
            json.dumps({"cells": [{"cell_type": "markdown", "source": "# OK"}]})
        )
        Path(d, "02_half.ipynb").write_text('{"cells": [')
        assert [c.title for c in discover_chapters(Path(d))] == ["OK"]
    assert "skipping 02_half.ipynb" in err.getvalue()


def test_the_repo_chapters():
    chapters = discover_chapters(REPO / "nbs")
    pool = next(c for c in chapters if c.stem == "12_block_pool")
    assert (pool.number, pool.title, pool.module, pool.section) == (
        12,
        "BlockPool",
        "v1.core.block_pool",
        "core",
    )
    # the kernels package's notebooks (nbs/kernels/) are chapters too: own page names, module under
    # `minivllm_kernels.`, in the kernels section after the numbered layer and attention chapters
    kern = [c for c in chapters if c.stem.startswith("kernels_")]
    assert {"kernels_00_reshape_and_cache", "kernels_01_unified_attention"} <= {c.stem for c in kern}
    assert all(c.section == "kernels" and c.module.startswith("minivllm_kernels.") and c.number is None for c in kern)
    sec = [c.stem for c in chapters if c.section == "kernels"]
    assert sec.index("kernels_00_reshape_and_cache") > sec.index("33_torch_attention_backend")


def test_mermaid_to_html():
    md = "Intro\n\n```mermaid\n%%| fig-width: 4\ngraph LR\n  A-->B\n\n  B-->|x<y|C\n```\n\n"
    md += "~~~{mermaid}\nsequenceDiagram\n~~~\n"
    out = mermaid_to_html(md)
    assert out.count('<pre class="mermaid">') == 2
    assert "A--&gt;B\n\n  B--&gt;|x&lt;y|C" in out and "%%|" not in out and "```" not in out
    assert mermaid_to_html("```python\nx = 1\n```") == "```python\nx = 1\n```"


def test_clean_notebook():
    md = "# Foo\n\n> one line\n> more\n\nBody\n\n```mermaid\ngraph LR\nA-->B\n```"
    echo = {"output_type": "stream", "name": "stdout", "text": "1\n"}
    nb = {
        "cells": [
            {"cell_type": "code", "source": "#| default_exp foo", "outputs": [], "metadata": {}},
            {"cell_type": "markdown", "source": md, "metadata": {}},
            {"cell_type": "code", "source": "#| export\ndef f(): pass", "outputs": [], "metadata": {}},
            {"cell_type": "code", "source": "#| hide\nsecret = 1", "outputs": [], "metadata": {}},
            {"cell_type": "code", "source": "#| echo: false\nprint(1)", "outputs": [echo], "metadata": {}},
            {"cell_type": "raw", "source": ["raw ", "text"], "metadata": {}},
        ]
    }
    before = json.dumps(nb)
    c = clean_notebook(nb, seed_html='<p class="seed-link">S</p>')
    assert json.dumps(nb) == before, "the notebook itself is left alone"
    assert [x["source"] for x in c["cells"]][1:] == ["def f(): pass", "print(1)", "raw text"]
    assert c["cells"][2]["metadata"] == {"tags": ["remove-input"]}
    assert c["cells"][0]["source"].startswith(
        '# Foo\n\n> one line\n> more\n\n<p class="seed-link">S</p>\n\nBody'
    )
    assert '<pre class="mermaid">' in c["cells"][0]["source"]
    assert [x["id"] for x in c["cells"]] == ["cell-0", "cell-1", "cell-2", "cell-3"]
    assert clean_notebook({"cells": []}, "Bare", "")["cells"][0]["source"] == "# Bare\n"


SEED_INDEX = """## 000_097d1cbd935fcfe7.txt — the main notes
| line | chapter | what |
|---:|---|---|
| 18 | テキスト推論データフロー (text inference data flow) | x |
| 1115 | EngineCore | y |
| 1257 | EngineCoreClient | z |
| 2633 | BlockPool | w |
## 001_79f342fd0fa46906.txt — glossary
KV Transfer, ...
"""


def test_seed_index_and_refs():
    sc = parse_seed_index(SEED_INDEX)
    assert [(c.line, c.title) for c in sc][:2] == [
        (18, "テキスト推論データフロー (text inference data flow)"),
        (1115, "EngineCore"),
    ]
    assert sc[-1] == SeedChapter("001_79f342fd0fa46906.txt", 1, "glossary")
    assert sc[0].names == ["テキスト推論データフロー", "text inference data flow"]
    text = (
        "Source: vLLM `vllm/v1/engine/__init__.py` (`EngineCoreRequest` line 55); "
        'seeds "テキスト推論データフロー" (line 18) and "EngineCoreClient" (line 1257).'
        "\n\nOther prose with a seed=3 argument, line 2700."
    )
    assert [(c.title, line) for c, line in seed_refs(text, "x", sc)] == [
        ("テキスト推論データフロー (text inference data flow)", 18),
        ("EngineCoreClient", 1257),
    ]
    assert [(c.title, line) for c, line in seed_refs("seeds, BlockPool free queue (line 2700)", "x", sc)] == [
        ("BlockPool", 2700)
    ]
    # no citation: the title's seed chapter names, whole words only (not EngineCoreClient)
    assert [c.title for c, _ in seed_refs("no citation", "EngineCore: step()", sc)] == ["EngineCore"]
    assert seed_refs("nothing", "Sampler", sc) == []
    refs = seed_refs("seeds (line 2700)", "", sc)
    assert 'href="seeds/000_097d1cbd935fcfe7.html#L2700"' in seed_link_html(refs, True)
    assert "href" not in seed_link_html(refs, False)
    page = seed_text_page("a.txt", "one\n<two>")
    assert 'id="L2"' in page and "&lt;two&gt;" in page and 'href="../_static/seed-text.css"' in page


def test_module_api():
    src = '''
__all__ = ["Foo", "bar", "LIMIT", "Missing"]
class Foo(Base):
    "A foo. Shapes: (n,)."
    x: int
    y: str = "a"
    def go(self, n: int) -> int:
        "Go n steps."
    def _private(self): pass
    @staticmethod
    def make(a): pass
def bar(a: int, *, b: float = 1.0) -> None:
    """Bar.

    More."""
LIMIT = 3
'''
    api = module_api(src)
    assert [(e.name, e.kind) for e in api] == [
        ("Foo", "class"),
        ("bar", "function"),
        ("LIMIT", "value"),
        ("Missing", "value"),
    ]
    assert api[0].signature == "class Foo(Base)\n    x: int\n    y: str"
    assert [(m.name, m.signature) for m in api[0].members] == [
        ("go", "go(n: int) -> int"),
        ("make", "make(a)"),
    ]
    assert api[1].signature == "def bar(a: int, *, b: float=1.0) -> None"
    assert api[2].signature == "LIMIT = 3"
    assert module_api("x = 1") is None


def test_api_and_home_pages():
    chapters = discover_chapters(REPO / "nbs")
    page = api_markdown(REPO / "minivllm", chapters)
    assert "# API reference" in page and "### `SamplingParams`" in page and "{ref}`SamplingParams <" in page
    assert "`minivllm.v1.core.block_pool`" in page and "Chapter: [BlockPool](12_block_pool.ipynb)" in page
    # the home page: one toctree per non-empty section, in sidebar order, every chapter in exactly one
    home = index_markdown("# minivllm\n", chapters, True)
    caps = re.findall(r"^:caption: (.+)$", home, re.M)
    assert caps == [v for k, v in SECTIONS.items() if any(c.section == k for c in chapters)] + ["Reference"]
    for c in chapters:
        assert len(re.findall(rf"^{re.escape(c.stem)}$", home, re.M)) == 1, c.stem


# --- executing the chapters (tools/docs/execute.py) ----------------------------------------------------

from tools.docs.build import build_site  # noqa: E402
from tools.docs.execute import ExecutionFailed, cache_key, with_outputs  # noqa: E402


def _code(src, **kw):
    return {"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": None, **kw}


def _repo(tmp: Path) -> Path:
    "A repo with nbs/ and the files the builder reads (settings.ini, README.md), no chapters yet."
    (tmp / "nbs").mkdir(parents=True)
    for name in ["settings.ini", "README.md"]:
        (tmp / name).write_text((REPO / name).read_text(encoding="utf-8"), encoding="utf-8")
    return tmp


def test_cache_key_and_outputs():
    nb = {"cells": [{"cell_type": "markdown", "source": "# T"}, _code("print(1)"), _code("x")]}
    k = cache_key(nb, set(), {"A": "1"})
    prose = {"cells": [{"cell_type": "markdown", "source": "# T, reworded"}, *nb["cells"][1:]]}
    assert cache_key(prose, set(), {"A": "1"}) == k  # prose does not change what a run prints
    assert cache_key({"cells": [nb["cells"][0], _code("print(2)"), _code("x")]}, set(), {"A": "1"}) != k
    assert cache_key(nb, {"slow"}, {"A": "1"}) != k and cache_key(nb, set(), {"A": "2"}) != k
    out = {"output_type": "stream", "name": "stdout", "text": ["1\n"]}
    got = with_outputs(nb, {1: [out]})
    assert got["cells"][1]["outputs"] == [out] and got["cells"][2]["outputs"] == [] and nb["cells"][1]["outputs"] == []


@pytest.mark.slow  # 10 s (it executes a chapter twice); `make test-slow`
def test_build_executes_caches_and_keeps_notebooks_clean(tmp_path):
    "Outputs (slow cells too, `eval: false` skipped) go on the page, not into the notebook; a rebuild hits the cache."
    repo = _repo(tmp_path / "repo")
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "markdown", "metadata": {}, "source": "# Tiny\n\n> Runs on the page."},
        _code("import os\nprint('six times seven is', 6 * 7, os.path.basename(os.getcwd()))"),
        _code("#| slow\nprint('the slow cell ran too')"),
        _code("#| eval: false\nraise SystemExit('never run')"),
        _code("{'example_model': os.environ.get('MINIVLLM_EXAMPLE_MODEL')}"),
    ]}
    path = repo / "nbs" / "01_tiny.ipynb"
    path.write_text(json.dumps(nb), encoding="utf-8")
    before = path.read_bytes()
    cache = tmp_path / "cache"
    out = build_site(repo, tmp_path / "site", seeds=False, cache=cache)
    page = (out / "01_tiny.html").read_text(encoding="utf-8")
    assert "six times seven is 42 nbs" in page  # run in the notebook's own folder, as nbdev_test does
    assert "the slow cell ran too" in page and "never run" in page  # the eval: false cell shown, not run
    assert page.count('<div class="cell_output') == 3
    assert "&#39;example_model&#39;: &#39;embedded&#39;" in page or "'example_model': 'embedded'" in page
    assert path.read_bytes() == before
    man = json.loads((out / "chapters.json").read_text(encoding="utf-8"))
    assert man[0]["executed"]["cached"] is False and len(list(cache.glob("01_tiny-*.json"))) == 1
    out = build_site(repo, tmp_path / "site", seeds=False, cache=cache)
    assert json.loads((out / "chapters.json").read_text(encoding="utf-8"))[0]["executed"]["cached"] is True
    assert "six times seven is 42" in (out / "01_tiny.html").read_text(encoding="utf-8")
    out = build_site(repo, tmp_path / "site", seeds=False, execute=False)  # --no-execute: outputs as saved
    assert "six times seven is 42" not in (out / "01_tiny.html").read_text(encoding="utf-8")


def test_build_fails_naming_the_chapter_and_cell(tmp_path):
    "A deliberately broken copy of a real chapter: the build stops, naming the notebook and the cell."
    repo = _repo(tmp_path / "repo")
    nb = json.loads((REPO / "nbs" / "12_block_pool.ipynb").read_text(encoding="utf-8"))
    at = next(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and "import" in "".join(c["source"]))
    nb["cells"].insert(at + 1, _code("pool_size = 8\nassert pool_size == 9, 'a deliberately broken cell'"))
    (repo / "nbs" / "12_block_pool.ipynb").write_text(json.dumps(nb), encoding="utf-8")
    with pytest.raises(ExecutionFailed) as e:
        build_site(repo, tmp_path / "site", seeds=False, cache=None)
    assert (e.value.chapter, e.value.cell) == ("nbs/12_block_pool.ipynb", at + 1)
    msg = str(e.value)
    assert msg.startswith(f"nbs/12_block_pool.ipynb, cell {at + 1}: AssertionError: a deliberately broken cell")
    assert "assert pool_size == 9" in msg and not (tmp_path / "site").exists()
    # the command line says the same and exits 1
    r = subprocess.run([sys.executable, str(REPO / "tools/docs/build.py"), "--repo", str(repo), "--no-seeds", "--out",
                        str(tmp_path / "site"), "--cache", str(tmp_path / "c")], cwd=repo, capture_output=True,
                       text=True)
    assert r.returncode == 1 and f"nbs/12_block_pool.ipynb, cell {at + 1}" in r.stderr, r.stderr[-2000:]
