"""The report as one self-contained HTML file: images are data URIs and the style is inline, so
the file can be mailed, attached or opened offline in any browser and still show everything."""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from html import escape
from pathlib import Path

import pandas as pd

from harness.trials import atomic_write

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
  max-width: 1100px; margin: 2rem auto; padding: 0 1rem; line-height: 1.5; color: #1f2328; }
h1, h2, h3 { line-height: 1.25; margin-top: 2rem; }
h1 { border-bottom: 2px solid #d0d7de; padding-bottom: .3rem; }
code, pre { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace;
  font-size: .9em; background: #f6f8fa; border-radius: 4px; }
code { padding: .1em .3em; }
pre { padding: .8rem 1rem; overflow-x: auto; border: 1px solid #d0d7de; }
.scroll { overflow-x: auto; margin: 1rem 0; }
table { border-collapse: collapse; font-size: .92em; }
th, td { border: 1px solid #d0d7de; padding: .35rem .7rem; text-align: left; white-space: nowrap; }
th { background: #eaeef2; }
tbody tr:nth-child(even) { background: #f6f8fa; }
td.flag { background: #fff1c2; color: #7d4e00; white-space: normal; min-width: 16rem; }
caption, figcaption { color: #57606a; font-size: .9em; padding: .3rem 0; text-align: left; }
figure { margin: 1.5rem 0; }
img { max-width: 100%; height: auto; display: block; border: 1px solid #eaeef2; }
"""


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class Paragraph:
    """Plain text; `backticked` spans are shown as code, as in the Markdown report."""

    text: str


@dataclass(frozen=True)
class Table:
    """Cells are shown as given (pre-formatted strings), blanks for missing values; non-empty
    cells of the `flag` column (a comparison's `differs`) are marked, so they catch the eye."""

    frame: pd.DataFrame
    caption: str = ""
    flag: str = ""


@dataclass(frozen=True)
class Image:
    """A PNG file, or its bytes, embedded in the page."""

    png: Path | bytes
    caption: str


@dataclass(frozen=True)
class Preformatted:
    """Text kept verbatim (the sweep's YAML), under an optional title."""

    text: str
    caption: str = ""


Block = Heading | Paragraph | Table | Image | Preformatted


def write_html(path: Path, title: str, blocks: list[Block]) -> None:
    """Write the page atomically, so a browser never shows a half-written report."""
    body = "\n".join(render(block) for block in blocks)
    page = (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n"
        f"<body>\n<h1>{escape(title)}</h1>\n{body}\n</body>\n</html>\n"
    )
    atomic_write(Path(path), page.encode("utf-8"))


def render(block: Block) -> str:
    """One block as HTML; every piece of text is escaped."""
    if isinstance(block, Heading):
        level = min(max(block.level, 2), 6)  # the page title is the only h1
        return f"<h{level}>{escape(block.text)}</h{level}>"
    if isinstance(block, Paragraph):
        return f"<p>{_inline_code(escape(block.text))}</p>"
    if isinstance(block, Table):
        return _table(block)
    if isinstance(block, Image):
        png = block.png if isinstance(block.png, bytes) else Path(block.png).read_bytes()
        uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        caption = escape(block.caption)
        return (f'<figure><img src="{uri}" alt="{caption}">'
                f"<figcaption>{caption}</figcaption></figure>")
    if isinstance(block, Preformatted):
        title = f"<figcaption>{escape(block.caption)}</figcaption>" if block.caption else ""
        return f"<figure>{title}<pre>{escape(block.text)}</pre></figure>"
    raise TypeError(f"not a report block: {block!r}")


def _table(table: Table) -> str:
    """A wide table scrolls sideways inside its box instead of widening the page."""
    frame = table.frame.fillna("")
    head = "".join(f"<th>{escape(str(c))}</th>" for c in frame.columns)
    flagged = [c == table.flag for c in frame.columns]
    rows = "\n".join(
        "<tr>" + "".join(_cell(v, flag) for v, flag in zip(row, flagged, strict=True)) + "</tr>"
        for row in frame.itertuples(index=False)
    )
    caption = f"<caption>{escape(table.caption)}</caption>" if table.caption else ""
    return (f'<div class="scroll"><table>{caption}<thead><tr>{head}</tr></thead>\n'
            f"<tbody>\n{rows}\n</tbody></table></div>")


def _cell(value: object, flag: bool) -> str:
    text = escape(str(value))
    return f'<td class="flag">{text}</td>' if flag and text else f"<td>{text}</td>"


def _inline_code(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
