"""The HTML report: one file, nothing fetched, and what headless Chromium draws from it."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from io import BytesIO
from pathlib import Path

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from services import chromium, headless
from test_plots import write_runs

from harness.analysis import load_runs, load_steps
from harness.analysis.figures import best_lr_trials, eval_curves, pareto_plot
from harness.analysis.html import Heading, Image, Paragraph, Preformatted, Table, write_html
from harness.analysis.plots import save_png

CELL = "galore-ZX81"  # a value no other part of the page contains
TABLE = pd.DataFrame({"method": [CELL, "<b>full</b> & co"], "eval ppl": ["26.00", None]})
YAML = "name: demo\nmethods: {full: {}, galore: {rank: 4}}\n"


class Page(HTMLParser):
    """The text of every table cell and the src of every image."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.cells: list[str] = []
        self.images: list[str] = []
        self._in_cell = False
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.images.append(dict(attrs).get("src") or "")
        if tag in ("td", "th"):
            self.cells.append("")
            self._in_cell = True

    def handle_endtag(self, tag: str) -> None:
        self._in_cell = self._in_cell and tag not in ("td", "th")

    def handle_data(self, data: str) -> None:
        if self._in_cell:
            self.cells[-1] += data


@pytest.fixture
def report(tmp_path: Path) -> Path:
    """A page with a table and two figures drawn from fixture runs."""
    runs = write_runs(tmp_path / "runs")
    best = best_lr_trials(load_runs(runs))
    eval_caption = save_png(*eval_curves(load_steps(runs), best, "demo"), tmp_path / "eval.png")
    figure, pareto_caption = pareto_plot(best, "demo")
    path = tmp_path / "report" / "report.html"
    write_html(path, "Sweep report: demo", [
        Paragraph("Memory columns use decimal units; all trials: `trials.csv`."),
        Heading("Summary"),
        Table(TABLE, caption="each method at its best LR"),
        Image(tmp_path / "eval.png", eval_caption),
        Image(_png(figure), pareto_caption),
        Preformatted(YAML, caption="sweep.yaml"),
    ])
    return path


def test_page_is_one_file_with_escaped_text(report: Path) -> None:
    html = report.read_text(encoding="utf-8")
    page = Page(html)
    assert page.cells == ["method", "eval ppl", CELL, "26.00", "<b>full</b> & co", ""]
    assert "&lt;b&gt;full&lt;/b&gt; &amp; co" in html
    assert len(page.images) == 2
    assert all(src.startswith("data:image/png;base64,") for src in page.images)
    # Nothing is fetched: no scripts, stylesheets or URLs other than the data URIs.
    assert not re.search(r"<script|<link|https?://|url\(", html)
    assert "<code>trials.csv</code>" in html
    assert "<pre>name: demo\nmethods: {full: {}, galore: {rank: 4}}\n</pre>" in html


def test_chromium_renders_the_tables_and_images(report: Path, tmp_path: Path) -> None:
    browser = chromium()
    dom = headless(browser, report, tmp_path / "profile", "--dump-dom")
    page = Page(dom)
    assert CELL in page.cells and "<b>full</b> & co" in page.cells
    assert len(page.images) == 2
    assert all(src.startswith("data:image/png;base64,") for src in page.images)

    shot = tmp_path / "shot.png"
    headless(browser, report, tmp_path / "profile", f"--screenshot={shot}",
             "--window-size=1200,2000")
    pixels = matplotlib.image.imread(shot)[:, :, :3]
    assert pixels.shape[:2] == (2000, 1200)
    assert pixels.std() > 0.05, "blank page"
    # The plots' own colours (method lines and points) appear only if the images were decoded:
    # C1 (full) is in both figures, so its rows must reach from the first into the second.
    rows = _rows_with(pixels, "C1")
    assert rows.size > 50 and rows.max() - rows.min() > 600
    # Above the first image: the table's header background and its striped row.
    table = pixels[: rows.min()]
    assert _rows_with(table, "#eaeef2").size and _rows_with(table, "#f6f8fa").size
    assert (table.sum(axis=2) < 1.0).any(), "no dark text above the images"


def _rows_with(pixels: np.ndarray, color: str) -> np.ndarray:
    """Rows holding at least a few pixels of `color` (to 8-bit rounding)."""
    close = (np.abs(pixels - np.array(to_rgb(color))) < 2.5 / 255).all(axis=2)
    return np.flatnonzero(close.sum(axis=1) >= 3)


def _png(figure: Figure) -> bytes:
    buffer = BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    return buffer.getvalue()


def test_the_sweep_report_page_renders_every_table_and_figure(tmp_path: Path) -> None:
    """`write_report`'s report.html, as a browser shows it: every table's cells and every
    figure written beside it, embedded; report.md points at the same figures."""
    from harness.analysis import write_report

    runs = write_runs(tmp_path / "runs")
    write_report(runs)
    out = runs / "report"
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert {"eval.png", "pareto.png", "throughput.png", "memory.png"} <= set(pngs)
    dom = Page(headless(chromium(), out / "report.html", tmp_path / "profile", "--dump-dom"))
    assert len(dom.images) == len(pngs)
    assert all(src.startswith("data:image/png;base64,") for src in dom.images)
    for table in ("pretrain.csv", "throughput.csv"):
        cells = pd.read_csv(out / table, dtype=str, keep_default_na=False).to_numpy().ravel()
        assert {c for c in cells if c} <= set(dom.cells)
    markdown = (out / "report.md").read_text()
    assert sorted(re.findall(r"\]\((\w+\.png)\)", markdown)) == pngs
    assert "sweep.yaml:" in markdown or not (runs / "sweep.yaml").exists()
