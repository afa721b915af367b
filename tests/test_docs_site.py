"""The docs site (tools/docs/, `make docs`): built offline into a temp dir, checked statically, then in
headless Chromium (DevTools protocol over websocket-client) with the network blocked.

The site built here has every page but executes only `EXECUTED` (a fresh cache, so they really run): the whole
run is `make docs` (minutes), too slow for the default suite. test_docs_build.py checks the executor."""
import base64
import html
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

# 100 s on a 2-core AVX2 CPU (it builds the site and starts Chromium): `make test-slow` runs it
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `tools.docs` is not installed: import it from the repo root

from tools.docs.api import KEY_NAMES, module_api  # noqa: E402
from tools.docs.build import build_site  # noqa: E402
from tools.docs.chapters import DIAGRAM_FENCE, discover_chapters  # noqa: E402
from tools.docs.seeds import MAIN_SEED, find_seeds  # noqa: E402

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
SCREENSHOTS = Path(os.environ.get("DOCS_SCREENSHOT_DIR", REPO / "build" / "docs-screenshots"))
_MERMAID_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*\{?mermaid\}?[ \t]*$", re.M)


def _public_names() -> set[str]:
    names = set()
    for py in (REPO / "minivllm").rglob("*.py"):
        try: entries = module_api(py.read_text(encoding="utf-8")) if py.name != "_modidx.py" else None
        except (SyntaxError, OSError): entries = None  # a module being rewritten right now
        names |= {e.name for e in entries or []}
    return names


@pytest.fixture(scope="module")
def names_before_build():
    "Public names in the package before the build (the build may see more: others keep exporting)."
    return _public_names()


# the chapters this site executes: the worked example of the block pool, and a model chapter (tiny Llama)
EXECUTED = ["12_block_pool", "34_llama"]


@pytest.fixture(scope="module")
def site(tmp_path_factory, names_before_build):
    tmp = tmp_path_factory.mktemp("docs")
    return build_site(REPO, tmp / "site", seeds=True, execute=EXECUTED, cache=tmp / "cache", jobs=2)


def _manifest(site: Path) -> dict[str, dict]:
    return {c["stem"]: c for c in json.loads((site / "chapters.json").read_text(encoding="utf-8"))}


@pytest.fixture(scope="module")
def chapters(site):
    "The chapters the site was built from (others may add notebooks while the tests run)."
    built = {c["file"] for c in json.loads((site / "chapters.json").read_text(encoding="utf-8"))}
    return [c for c in discover_chapters(REPO / "nbs") if c.path.name in built]


def _markdown(nb_path: Path) -> str:
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    return "\n".join("".join(c["source"]) if isinstance(c["source"], list) else c["source"]
                     for c in nb["cells"] if c["cell_type"] == "markdown")


def _page(site: Path, name: str) -> str:
    return (site / name).read_text(encoding="utf-8")


def test_every_notebook_has_a_page(site, chapters):
    assert len(chapters) >= 1
    for ch in chapters:
        page = site / f"{ch.stem}.html"
        assert page.exists(), f"no page for {ch.path.name}"
        assert re.search(r"<h1>.+</h1>", _page(site, page.name), re.S), f"{page.name} has no title"
    for name in ["index.html", "api.html", "seed_notes.html", "_static/mermaid.min.js", "_static/mermaid-init.js"]:
        assert (site / name).exists(), name


def test_sidebar_follows_reading_order(site, chapters):
    home = _page(site, "index.html")
    pos = [home.find(f'href="{c.stem}.html"') for c in chapters]
    assert all(p >= 0 for p in pos)
    by_section = {}
    for c, p in zip(chapters, pos): by_section.setdefault(c.section, []).append(p)
    for sec, ps in by_section.items(): assert ps == sorted(ps), f"section {sec} out of order"


def test_mermaid_blocks_become_diagram_containers(site, chapters):
    with_diagrams = [c for c in chapters if _MERMAID_FENCE.search(_markdown(c.path))]
    assert with_diagrams, "no notebook has a mermaid diagram"
    for ch in with_diagrams:
        page = _page(site, f"{ch.stem}.html")
        n_fences = len(_MERMAID_FENCE.findall(_markdown(ch.path)))
        assert page.count('<pre class="mermaid">') >= n_fences, ch.stem
        assert "language-mermaid" not in page and "highlight-mermaid" not in page, ch.stem  # not a code block
        assert 'src="_static/mermaid.min.js' in page and 'src="_static/mermaid-init.js' in page, ch.stem


def test_diagrams_use_one_fence(chapters):
    "Every diagram opens with the project's one fence, `DIAGRAM_FENCE` (see tools/docs/README.md)."
    for ch in chapters:
        for m in _MERMAID_FENCE.finditer(_markdown(ch.path)):
            assert m.group(0).strip() == DIAGRAM_FENCE, f"{ch.path.name}: use {DIAGRAM_FENCE}, not {m.group(0).strip()!r}"


def test_no_page_loads_anything_from_outside(site):
    for p in site.rglob("*.html"):
        text = p.read_text(encoding="utf-8", errors="replace")
        for tag in re.findall(r"<(?:script|link|img|iframe)\b[^>]*>", text):
            assert not re.search(r"""(?:src|href)=["']?(?:https?:)?//""", tag), f"{p.name}: {tag}"


def test_links_between_pages_resolve(site):
    checked = 0
    for p in site.rglob("*.html"):
        text = p.read_text(encoding="utf-8", errors="replace")
        tags = re.findall(r"<(?:a|link|script|img)\b[^>]*>", text)
        for url in [u for t in tags for u in re.findall(r"""\b(?:href|src)="([^"]+)\"""", t)]:
            if re.match(r"^(?:[a-z]+:|#|//)", url) or "{" in url: continue
            path, _, anchor = url.partition("#")
            target = (p.parent / path.split("?")[0]).resolve()
            assert target.exists(), f"{p.relative_to(site)} links to missing {url}"
            if anchor and target.suffix == ".html" and target.parent.name == "seeds":
                assert f'id="{anchor}"' in target.read_text(encoding="utf-8"), f"{p.name}: no anchor {url}"
            checked += 1
    assert checked > 50


def test_api_page_lists_the_public_names(site, names_before_build):
    api = _page(site, "api.html")
    expected = [n for n in KEY_NAMES if n in names_before_build]
    assert "SamplingParams" in expected  # exists since the scaffold; the others as they land
    for name in expected:
        assert re.search(rf"<h3[^>]*>.*?<span class=\"pre\">{name}</span>", api), f"{name} missing from the API page"
    assert "Start here" in api


def test_chapter_pages_link_their_seed_chapter(site, chapters):
    for ch in chapters:
        assert 'class="seed-link"' in _page(site, f"{ch.stem}.html"), ch.stem
    if find_seeds(REPO) is None:
        pytest.skip("seed texts not found beside the repo ($MINIVLLM_SEEDS or ../shared/seeds)")
    seed_page = site / "seeds" / MAIN_SEED.replace(".txt", ".html")
    assert seed_page.exists() and 'id="L18"' in seed_page.read_text(encoding="utf-8")
    engine = next((c for c in chapters if c.stem.startswith("04_")), None)
    if engine is not None:
        assert f'href="seeds/{Path(MAIN_SEED).stem}.html#L18"' in _page(site, f"{engine.stem}.html")


def _text(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def _outputs(page: str) -> list[str]:
    "The text of each cell output block on a page (myst-nb's `cell_output` containers)."
    parts = page.split('<div class="cell_output docutils container">')[1:]
    return [_text(p.split('<div class="cell docutils container">')[0]) for p in parts]


def test_executed_chapters_show_their_outputs(site):
    "The executed chapters' pages carry the real printed values of their worked examples."
    man = _manifest(site)
    assert all(man[s]["executed"] and not man[s]["executed"]["cached"] for s in EXECUTED), man
    pool = _outputs(_page(site, "12_block_pool.html"))
    # BlockPool(8 blocks): 3 blocks of request A allocated out of 7 usable, then freed in reverse
    assert any("usage 0.43" in o for o in pool), pool
    assert any("[4, 5, 6, 7, 3, 2, 1]" in o for o in pool), pool
    llama = _outputs(_page(site, "34_llama.html"))
    assert any("LlamaDecoderLayer(" in o for o in llama), llama  # the model's first layer, printed
    assert any(re.search(r"next tokens: \[\d+, \d+\] max \|logits - hf\|:", o) for o in llama), llama
    # the committed notebooks stay clean: the outputs live only in the built pages
    nb = json.loads((REPO / "nbs" / "12_block_pool.ipynb").read_text(encoding="utf-8"))
    assert not any(c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")


def test_cell_outputs_appear_as_saved(site, chapters):
    "A chapter the build did not execute shows the outputs saved in its notebook."
    found, man = 0, _manifest(site)
    for ch in [c for c in chapters if not man[c.stem]["executed"]]:
        nb = json.loads(ch.path.read_text(encoding="utf-8"))
        for cell in nb["cells"]:
            for out in cell.get("outputs", []):
                text = out.get("text") or out.get("data", {}).get("text/plain")
                text = "".join(text) if isinstance(text, list) else text
                line = next((l.strip() for l in (text or "").splitlines() if len(l.strip()) > 8), None)
                if line and "#| hide" not in "".join(cell["source"]) and "\x1b" not in line:
                    page = _text(_page(site, f"{ch.stem}.html"))
                    assert line in page, f"{ch.stem}: output line {line!r} not on the page"
                    found += 1
                    break
            if found and found % 3 == 0: break
    if not found: pytest.skip("no notebook has saved text outputs yet")


PNG_1x1 = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")


def _outputs_notebook() -> dict:
    "A chapter with saved outputs of each kind the site must show: stream text, an HTML table, a PNG figure."
    out = lambda **kw: kw
    return {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "markdown", "metadata": {}, "source": "# Saved outputs\n\n> Shown as saved.\n\n```mermaid\ngraph LR\nA-->B\n```"},
        {"cell_type": "code", "metadata": {}, "execution_count": 1, "source": "print(req)",
         "outputs": [out(output_type="stream", name="stdout", text=["EngineCoreRequest(request_id='0-abc', prompt_token_ids=[1, 2])\n"])]},
        {"cell_type": "code", "metadata": {}, "execution_count": 2, "source": "df",
         "outputs": [out(output_type="execute_result", execution_count=2, metadata={},
                         data={"text/plain": ["table"], "text/html": ["<table class='saved'><tr><td>blocks=7</td></tr></table>"]})]},
        {"cell_type": "code", "metadata": {}, "execution_count": 3, "source": "plt.plot()",
         "outputs": [out(output_type="display_data", metadata={}, data={"image/png": PNG_1x1, "text/plain": ["<Figure>"]})]},
    ]}


def test_builds_without_seeds_and_shows_saved_outputs(tmp_path):
    """A clone without ../shared/seeds still builds (seed chapters named, unlinked); saved outputs appear."""
    repo = tmp_path / "repo"
    (repo / "nbs").mkdir(parents=True)
    for name in ["settings.ini", "README.md"]: shutil.copy(REPO / name, repo / name)
    (repo / "minivllm").mkdir()
    shutil.copy(REPO / "minivllm" / "sampling_params.py", repo / "minivllm")
    real = next(p for p in sorted((REPO / "nbs").glob("0[1-9]*_*.ipynb")) if _MERMAID_FENCE.search(_markdown(p)))
    shutil.copy(real, repo / "nbs")
    (repo / "nbs" / "97_outputs.ipynb").write_text(json.dumps(_outputs_notebook()))
    out = build_site(repo, tmp_path / "site", seeds=False, execute=False)  # as saved: nothing run
    assert not (out / "seeds").exists()
    assert (out / f"{real.stem}.html").exists() and (out / "97_outputs.html").exists()
    assert "SamplingParams" in _page(out, "api.html")
    engine = _page(out, f"{real.stem}.html")
    assert 'href="seeds/' not in engine and 'href="seed_notes.html"' in engine
    assert "seed texts were not found" in _page(out, "seed_notes.html")
    page = _page(out, "97_outputs.html")
    assert "EngineCoreRequest(request_id=&#39;0-abc&#39;" in page or "EngineCoreRequest(request_id='0-abc'" in page
    assert "<table class='saved'>" in page or '<table class="saved">' in page
    imgs = re.findall(r'<img[^>]+src="([^"]+)"', page)
    assert any((out / src).exists() and src.endswith(".png") for src in imgs), imgs
    assert '<pre class="mermaid">' in page


# --- the browser test ---------------------------------------------------------------------------------

class _CDP:
    "A minimal Chrome DevTools Protocol client: send a command, wait for its reply, keep the events."

    def __init__(self, ws_url: str):
        import websocket
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.next_id, self.events = 0, []

    def __call__(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg: raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def eval(self, expr: str):
        return self("Runtime.evaluate", expression=expr, returnByValue=True)["result"].get("value")


def _start_chromium(profile: Path):
    proc = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-extensions",
         "--disable-default-apps", "--mute-audio", f"--user-data-dir={profile}", "--remote-debugging-port=0",
         "--remote-debugging-address=127.0.0.1",
         # network off: every non-file request goes to a dead proxy, every host name fails to resolve
         "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
         "--disable-dev-shm-usage", "--window-size=1280,1600", "--hide-scrollbars", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    port_file, deadline = profile / "DevToolsActivePort", time.time() + 30
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.time() > deadline:
            err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.poll() is not None else "timeout"
            _stop(proc)
            pytest.fail(f"chromium did not start: {err}")
        time.sleep(0.1)
    port = int(port_file.read_text().split()[0])
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for _ in range(100):
        targets = json.loads(opener.open(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        pages = [t for t in targets if t.get("type") == "page"]
        if pages: return proc, pages[0]["webSocketDebuggerUrl"]
        time.sleep(0.1)
    _stop(proc)
    pytest.fail("chromium has no page target")


def _stop(proc):
    try: os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError: return
    try: proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _open_and_render(cdp: _CDP, url: str, shot: Path) -> dict:
    cdp("Page.navigate", url=url)
    deadline, state = time.time() + 20, None
    while time.time() < deadline:
        state = cdp.eval("document.readyState === 'complete' ? (document.documentElement.dataset.mermaid || 'pending') : 'loading'")
        if state in ("done", "error", "missing"): break
        time.sleep(0.2)
    info = cdp.eval("""JSON.stringify({
        blocks: document.querySelectorAll('pre.mermaid').length,
        svgs: document.querySelectorAll('pre.mermaid svg').length,
        nodes: document.querySelectorAll('pre.mermaid svg g, pre.mermaid svg text').length,
        title: document.title})""")
    shot.parent.mkdir(parents=True, exist_ok=True)
    shot.write_bytes(base64.b64decode(cdp("Page.captureScreenshot", format="png")["data"]))
    return {"state": state, **json.loads(info)}


_LAYOUT_JS = """(() => {
  const col = document.querySelector('article[role=main]') || document.querySelector('article');
  const right = col.getBoundingClientRect().right;
  const pres = [...col.querySelectorAll('div.highlight pre')];
  const over = pres.filter(p => p.scrollWidth > p.clientWidth + 1 || p.getBoundingClientRect().right > right + 1)
                   .map(p => p.textContent.slice(0, 60));
  const wrapped = pres.filter(p => {
    const lh = parseFloat(getComputedStyle(p).lineHeight), lines = p.textContent.replace(/\\n$/, '').split('\\n').length;
    return p.scrollHeight > (lines + 0.8) * lh;
  }).length;
  const outs = [...col.querySelectorAll('div.cell_output')];
  const shown = o => { const r = o.getBoundingClientRect(), cs = getComputedStyle(o);
    return r.height > 5 && r.width > 100 && cs.visibility === 'visible' && cs.display !== 'none'; };
  const outPre = col.querySelector('div.cell_output pre');
  return JSON.stringify({pres: pres.length, over, wrapped, outs: outs.length, hidden: outs.filter(o => !shown(o)).length,
    taller_than_screen: outs.filter(o => o.getBoundingClientRect().height > innerHeight).length,
    out_max_height: outPre ? getComputedStyle(outPre).maxHeight : null,
    out_text: outs.map(o => o.innerText).join('\\n'), page_width: document.documentElement.scrollWidth, vw: innerWidth});
})()"""


def test_browser_renders_diagrams_offline(site, chapters):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM}: `apt-get install -y chromium` (CI's .ci/run installs it)")
    pytest.importorskip("websocket", reason="websocket-client is in the dev extra")
    chapter = next((c for c in chapters if c.stem.startswith("00_") and _MERMAID_FENCE.search(_markdown(c.path))),
                   None) or next(c for c in chapters if _MERMAID_FENCE.search(_markdown(c.path)))
    with tempfile.TemporaryDirectory(prefix="minivllm-chromium-") as profile:
        proc, ws_url = _start_chromium(Path(profile))
        try:
            cdp = _CDP(ws_url)
            cdp("Network.enable")
            cdp("Page.enable")
            results = {}
            for name in ["index.html", f"{chapter.stem}.html"]:
                results[name] = r = _open_and_render(cdp, (site / name).as_uri(), SCREENSHOTS / name.replace(".html", ".png"))
                assert r["state"] == "done", f"{name}: mermaid state {r['state']}"
                assert r["blocks"] >= 1 and r["svgs"] == r["blocks"], f"{name}: {r}"
                assert r["nodes"] > 3, f"{name}: empty diagram {r}"
            # an executed chapter: its outputs are on screen, code wraps inside the content column (long
            # lines exist: some block wraps), a long output is folded into its own scrolling box
            _open_and_render(cdp, (site / "12_block_pool.html").as_uri(), SCREENSHOTS / "12_block_pool.png")
            lay = json.loads(cdp.eval(_LAYOUT_JS))
            assert lay["outs"] >= 3 and lay["hidden"] == 0, {k: v for k, v in lay.items() if k != "out_text"}
            assert "usage 0.43" in lay["out_text"], lay["out_text"][:500]
            assert lay["pres"] > 10 and not lay["over"], f"code runs past the content column: {lay['over']}"
            assert lay["wrapped"] >= 1, "no long line wrapped: the check would not see an overflow"
            assert lay["out_max_height"] not in (None, "none") and lay["taller_than_screen"] == 0, lay
            assert lay["page_width"] <= lay["vw"], "the page scrolls sideways"
            requested = {e["params"]["request"]["url"] for e in cdp.events if e.get("method") == "Network.requestWillBeSent"}
            outside = sorted(u for u in requested if not u.startswith(("file:", "data:", "blob:", "about:")))
            assert not outside, f"pages asked the network for {outside}"
            cdp.ws.close()
        finally:
            _stop(proc)
    assert (SCREENSHOTS / "index.png").stat().st_size > 10_000
