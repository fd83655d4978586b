"""A report as a list of blocks, rendered to Markdown (images as relative links) and to one self-contained
HTML file (images embedded as base64 data URIs, no external assets; links such as `[appendix](report_configs.md)`
in a text stay links), so both copies always say the same."""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Heading:
    """A section title (level 1-4)."""

    text: str
    level: int = 2


@dataclass
class Text:
    """A paragraph; `code` spans in backticks and **bold** are rendered in both formats."""

    text: str


@dataclass
class Bullets:
    """A bulleted list of one-line items (inline `code`, **bold** and [links](target) rendered)."""

    items: list[str]


@dataclass
class Table:
    """A table of strings with a header row."""

    header: list[str]
    rows: list[list[str]]


@dataclass
class Image:
    """A PNG file (relative to the report's folder in Markdown, embedded in HTML)."""

    path: Path
    alt: str


@dataclass
class Code:
    """A verbatim block (a config, an environment record)."""

    text: str
    lang: str = ""


@dataclass
class Details:
    """A collapsed section (`<details>`, which GitHub's Markdown renders too)."""

    summary: str
    blocks: list[Block] = field(default_factory=list)


Block = Heading | Text | Bullets | Table | Image | Code | Details


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: list[Block], root: Path) -> str:
    """Markdown with image links relative to `root` (the folder report.md is written to)."""
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append("#" * b.level + " " + b.text)
        elif isinstance(b, Text):
            out.append(b.text)
        elif isinstance(b, Bullets):
            out.append("\n".join(f"- {_md_cell(item)}" for item in b.items))
        elif isinstance(b, Table):
            lines = ["| " + " | ".join(map(_md_cell, b.header)) + " |", "|" + " --- |" * len(b.header)]
            lines += ["| " + " | ".join(map(_md_cell, r)) + " |" for r in b.rows]
            out.append("\n".join(lines))
        elif isinstance(b, Image):
            out.append(f"![{b.alt}]({Path(b.path).resolve().relative_to(root.resolve()).as_posix()})")
        elif isinstance(b, Code):
            out.append(f"```{b.lang}\n{b.text.rstrip()}\n```")
        elif isinstance(b, Details):
            out.append(
                f"<details><summary>{html.escape(b.summary)}</summary>\n\n{to_markdown(b.blocks, root)}\n\n</details>"
            )
    return "\n\n".join(out) + "\n"


def _inline(text: str) -> str:
    t = html.escape(text)
    t = re.sub(r"`([^`]+)`", r"<code>\1</code>", t)
    t = re.sub(r"\[([^\]\[]+)\]\(([^()\s]+)\)", r'<a href="\2">\1</a>', t)  # [text](relative/link.md)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", t)


def _html_blocks(blocks: list[Block]) -> str:
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append(f"<h{b.level}>{_inline(b.text)}</h{b.level}>")
        elif isinstance(b, Text):
            out.append(f"<p>{_inline(b.text)}</p>")
        elif isinstance(b, Bullets):
            out.append("<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in b.items) + "</ul>")
        elif isinstance(b, Table):
            head = "".join(f"<th>{_inline(h)}</th>" for h in b.header)
            body = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in b.rows)
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif isinstance(b, Image):
            data = base64.b64encode(Path(b.path).read_bytes()).decode("ascii")
            out.append(f'<figure><img alt="{html.escape(b.alt)}" src="data:image/png;base64,{data}"></figure>')
        elif isinstance(b, Code):
            out.append(f"<pre><code>{html.escape(b.text.rstrip())}</code></pre>")
        elif isinstance(b, Details):
            out.append(f"<details><summary>{_inline(b.summary)}</summary>{_html_blocks(b.blocks)}</details>")
    return "\n".join(out)


STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }
th:first-child, td:first-child, th:nth-child(2), td:nth-child(2) { text-align: left; }
th { background: #f3f3f3; }
img { max-width: 100%; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
code { background: #f3f3f3; padding: 0 0.2em; }
details { margin: 0.4em 0; }
"""


def to_html(blocks: list[Block], title: str) -> str:
    """One self-contained HTML page: inline CSS, every image embedded as base64."""
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>\n{_html_blocks(blocks)}\n</body></html>\n"
    )
