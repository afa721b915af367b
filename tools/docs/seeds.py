"""Links from the chapters to the seed notes (the code-reading notes on vLLM v1 that minivllm implements).

Each chapter cites the seed notes in its "Source:" paragraph: the word *seeds*, then quoted chapter titles
and `(line N)` references into the main notes. The seeds' README indexes the chapters of the main notes by
starting line. The seed texts live outside the repo (`../shared/seeds` beside it, or `$MINIVLLM_SEEDS`); when
they are there the site carries them as `seeds/<file>.html` with an anchor per line, and when they are not the
pages still name the seed chapters, unlinked.
"""

from __future__ import annotations

import html
import os
import re
from dataclasses import dataclass
from pathlib import Path

MAIN_SEED = "000_097d1cbd935fcfe7.txt"


@dataclass(frozen=True)
class SeedChapter:
    "A chapter of the seed notes: file, first line, title as the seeds' README gives it."

    file: str
    line: int
    title: str

    @property
    def names(self) -> list[str]:
        """The title and its gloss in parentheses as separate names
        (`テキスト推論データフロー`, `text inference data flow`)."""
        m = re.match(r"^(.*?)\s*\((.+)\)\s*$", self.title)
        return [m.group(1), m.group(2)] if m and m.group(1) else [self.title]


def find_seeds(repo: Path) -> Path | None:
    "The seed-notes folder: `$MINIVLLM_SEEDS`, else `../shared/seeds` beside the repo; None if neither is."
    for p in [os.environ.get("MINIVLLM_SEEDS"), Path(repo).resolve().parent / "shared" / "seeds"]:
        if p and Path(p, MAIN_SEED).exists():
            return Path(p)
    return None


def parse_seed_index(readme: str) -> list[SeedChapter]:
    "Seed chapters from the seeds' README: `## <file>.txt — ...` headings, `| line | chapter | ... |` rows."
    out, cur = [], None
    for line in readme.splitlines():
        if h := re.match(r"^##\s+(\S+\.txt)\s*(?:[—-]+\s*(.*))?$", line):
            cur = h.group(1)
            out.append(SeedChapter(cur, 1, (h.group(2) or cur).strip()))
        elif cur and (r := re.match(r"^\|\s*(\d+)\s*\|\s*(.+?)\s*\|", line)):
            first_row = out and out[-1].file == cur and out[-1].line == 1
            if first_row and not any(c.file == cur and c.line > 1 for c in out):
                out.pop()  # a file with a table: its rows replace the heading entry
            out.append(SeedChapter(cur, int(r.group(1)), r.group(2)))
    return out


def _containing(chapters: list[SeedChapter], file: str, line: int) -> SeedChapter | None:
    candidates = (c for c in chapters if c.file == file and c.line <= line)
    return max(candidates, key=lambda c: c.line, default=None)


def _by_name(chapters: list[SeedChapter], quoted: str) -> SeedChapter | None:
    q = quoted.strip().lower()
    return next((c for c in chapters if q in [n.lower() for n in c.names] or q == c.title.lower()), None)


def seed_refs(chapter_text: str, title: str, chapters: list[SeedChapter]) -> list[tuple[SeedChapter, int]]:
    """The (seed chapter, line) pairs a notebook cites, in order of first mention.

    Only the text after the word "seeds" in a paragraph is scanned (the same paragraph cites vLLM source line
    numbers before it). A `line N` maps to the seed chapter containing line N and links to line N itself; a
    quoted chapter name maps to its first line. A chapter that cites nothing recognisable falls back to seed
    chapter names found in its `title`."""
    refs: list[tuple[SeedChapter, int]] = []

    def add(ch, line):
        if ch and all(c != ch for c, _ in refs):
            refs.append((ch, line))

    for para in re.split(r"\n\s*\n", chapter_text):
        m = re.search(r"\bseeds\b|\bseed (?:chapter|notes?)\b", para, re.I)
        if not m:
            continue
        for tok in re.finditer(r"\blines? (\d+)|[\"“「](.+?)[\"”」]", para[m.start() :]):
            if tok.group(1):
                add(_containing(chapters, MAIN_SEED, int(tok.group(1))), int(tok.group(1)))
            else:
                ch = _by_name(chapters, tok.group(2))
                add(ch, ch.line if ch else 0)
    if not refs:
        for c in chapters:
            if any(re.search(rf"(?<![\w]){re.escape(n)}(?![\w])", title) for n in c.names):
                add(c, c.line)
    return refs


def seed_link_html(refs: list[tuple[SeedChapter, int]], have_texts: bool) -> str:
    "The HTML line under a chapter's title that links (or, without the texts, names) its seed chapters."
    if not refs:
        return '<p class="seed-link">Seed notes: <a href="seed_notes.html">index of the seed chapters</a></p>'
    parts = []
    for ch, line in refs:
        label = html.escape(ch.title)
        where = f"{ch.file}, line {line}"
        if have_texts:
            parts.append(f'<a href="seeds/{Path(ch.file).stem}.html#L{line}" title="{where}">{label}</a>')
        else:
            missing = f"({where}; seed texts not available at build time)"
            parts.append(f'{label} <span class="seed-missing">{missing}</span>')
    plural = "s" if len(parts) > 1 else ""
    return f'<p class="seed-link">Implements seed chapter{plural}: ' + " · ".join(parts) + "</p>"


def seed_text_page(name: str, text: str) -> str:
    """A standalone HTML page of one seed text, one `id="L<n>"` anchor per line, linking back to the site.

    The page lives in the site's `seeds/` folder and takes its style from `_static/seed-text.css`."""
    rows = "".join(
        f'<span class="l" id="L{i}"><a href="#L{i}">{i}</a>{html.escape(line) or " "}</span>'
        for i, line in enumerate(text.splitlines(), 1)
    )
    title = html.escape(name)
    return (
        '<!doctype html>\n<html lang="ja"><head><meta charset="utf-8">'
        f"<title>{title} · minivllm seed notes</title>\n"
        '<link rel="stylesheet" href="../_static/seed-text.css"></head>\n'
        '<body><header><a href="../index.html">minivllm</a> · <a href="../seed_notes.html">seed notes</a>'
        f" · {title}</header>\n<pre>{rows}</pre></body></html>\n"
    )
