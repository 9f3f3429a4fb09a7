"""Rebuild the embedded sample corpus and tokenizer in harness/data/sample.

The corpus is English prose from the Python 3.11 documentation (PSF License), read
from the reStructuredText sources in the Debian package python3.11-doc. Markup, code,
tables and short or unpunctuated lines are removed; the documents are written in the
file layout and JSON schema of C4, and a byte-level BPE tokenizer is trained on the
train split. Running it twice gives byte-identical files.

Usage: python scripts/build_sample.py [--source DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import re
import subprocess
import unicodedata
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

PACKAGE = "python3.11-doc"
SOURCE = Path("/usr/share/doc/python3.11/html/_sources")
COPYRIGHT = Path(f"/usr/share/doc/{PACKAGE}/copyright")
OUT = Path(__file__).resolve().parent.parent / "harness" / "data" / "sample"
BASE_URL = "https://docs.python.org/3.11/"
SKIP_PAGES = {"contents", "copyright", "license", "whatsnew/changelog"}  # no prose / legal
MIN_DOC_WORDS, MAX_DOC_WORDS, DEDUP_MIN_WORDS, MIN_PARA_WORDS = 100, 1200, 12, 3
VALID_MOD, VOCAB_SIZE, SEED = 20, 8192, 0  # validation: sha256(url) % 20 == 0, ~5%
SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]  # ids 0, 1 (EOS), 2

UNDERLINE = re.compile(r"^([!-/:-@\[-`{-~])\1{2,}\s*$")
DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
EXPLICIT = re.compile(r"^\s*\.\.(\s|$)")
LABEL = re.compile(r"^\s*\.\.\s+_([^:`]+):\s*$")
BULLET = re.compile(r"^\s*(?:[-*+\u2022]|#\.|\d+[.)]|\(\d+\)|\(?[a-z]\))\s+(?=\S)")
SIMPLE_TABLE = re.compile(r"^\s*=+(\s+=+)+\s*$")
FIELD = re.compile(r"^\s*:[\w -]+:(\s|$)")
TERMINAL = re.compile(r"[.!?][\"')\u201d\u2019]*$")
INLINE = re.compile(
    r"``(?P<literal>.+?)``"
    r"|(?::(?P<role>[\w:+.-]+):)?`(?P<body>[^`]+)`(?:__?)?"
    r"|(?P<footnote>\s*\[(?:#[\w-]*|\*|\d+|[A-Za-z][\w-]*)\]_)"
    r"|\*\*(?P<strong>\S.*?)\*\*"
    r"|(?<![\w*\\])\*(?P<em>(?:\\.|[^\s*\\])(?:(?:\\.|[^*\\])*?(?:\\.|[^\s*\\]))?)\*(?![\w*])"
    r"|\\(?P<escape>.)|\|(?P<subst>[\w.-]+)\||(?<=\s)(?P<dash>---?)(?=\s)"
    r"|(?<![\w-])(?P<target>[A-Za-z][\w-]*[A-Za-z0-9])_(?!\w)",
    re.S,
)
DEBRIS = re.compile(r"``|`|(?<!\w):[a-z]+(?::[a-z]+)?:|(^|\s)\.\.\s|::|\*\*|\|\w+\||^[>$]")
KEEP = {"note", "warning", "important", "tip", "caution", "attention", "hint", "danger",
        "error", "seealso", "impl-detail", "glossary", "epigraph"}
TITLED = {"topic", "sidebar", "admonition", "availability", "only"}  # drop argument only
OBJECT = {"function", "method", "class", "attribute", "data", "exception", "decorator",
          "decoratormethod", "classmethod", "staticmethod", "abstractmethod", "describe",
          "coroutinefunction", "coroutinemethod", "awaitablefunction", "awaitablemethod",
          "opcode", "cmdoption", "option", "envvar", "object", "pdbcommand"}
VERSION = {"versionadded": "New in version {}", "versionchanged": "Changed in version {}",
           "deprecated": "Deprecated since version {}",
           "deprecated-removed": "Deprecated since version {}, will be removed in version {}"}
SUBSTITUTIONS = {"version": "3.11", "release": "3.11.2"}


@dataclass
class Section:
    """A titled run of plain-text paragraphs from one page."""

    title: str
    paras: list[str] = field(default_factory=list)


def indent(line: str) -> int:
    """Number of leading spaces of a line."""
    return len(line) - len(line.lstrip(" "))


def make_id(title: str) -> str:
    """HTML anchor of a section title, derived as docutils does."""
    text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode().lower()
    return re.sub(r"^[-0-9]+|-+$", "", "-".join(re.findall(r"[a-z0-9]+", text)))


def match_title(lines: list[str], i: int) -> tuple[str, int] | None:
    """Return (title, lines used) if a section title starts at line i."""
    if UNDERLINE.match(lines[i]):
        if i + 2 < len(lines) and lines[i + 2].strip() == lines[i].strip():
            return lines[i + 1].strip(), 3
        return None
    if indent(lines[i]) == 0 and i + 1 < len(lines) and UNDERLINE.match(lines[i + 1]) and (
            i == 0 or not lines[i - 1].strip()):
        return lines[i].strip(), 2
    return None


def render_role(role: str | None, body: str, refs: dict[str, str]) -> str:
    """Plain text of interpreted text or a hyperlink reference, as Sphinx renders it."""
    m = re.fullmatch(r"(.*?)\s*<([^<>]+)>", body, re.S)
    if m and m[1]:
        return m[1]
    target = (m[2] if m else body).strip()
    if role in ("pep", "rfc"):
        return f"{role.upper()} {target.split('#')[0]}"
    if role in ("issue", "gh"):
        return f"{'bpo' if role == 'issue' else 'gh'}-{target}"
    if role == "ref":
        return refs.get(target.lower(), target.replace("-", " "))
    if role == "token":
        return target.split(":")[-1]
    if role == "abbr":
        return re.sub(r"\s*\(.*\)$", "", target, flags=re.S)
    text = re.sub(r"\\(.)", r"\1", target)
    text = re.sub(r"[{}]", "", text) if role in ("samp", "file") else text.lstrip("!.")
    if text.startswith("~"):
        text = text[1:].split(".")[-1]
    if role in ("func", "meth", "c:func") and not text.endswith(")"):
        text += "()"
    return text


def inline(text: str, refs: dict[str, str]) -> str:
    """Replace inline reST markup by its rendered text and normalise whitespace."""

    def repl(m: re.Match[str]) -> str:
        if m["literal"] is not None:
            return m["literal"]
        if m["body"] is not None:
            return render_role(m["role"], m["body"], refs)
        if m["escape"] is not None:
            return "" if m["escape"].isspace() else m["escape"]
        if m["dash"]:
            return "\u2014" if m["dash"] == "---" else "\u2013"
        if m["subst"]:
            return SUBSTITUTIONS.get(m["subst"], m["subst"])
        if m["target"]:  # "name_" refers to a target of the page, if it defines one
            return m["target"] if m["target"].lower() + "_" in refs else m[0]
        return inline(m["strong"] or m["em"] or "", refs)  # footnote references vanish

    return " ".join(INLINE.sub(repl, text).split())


def read_paragraph(lines: list[str], i: int) -> tuple[str, bool, int, int]:
    """Read the paragraph at line i: (text, is list item, text column, next line)."""
    bullet = BULLET.match(lines[i])
    col = bullet.end() if bullet else indent(lines[i])
    parts, j = [lines[i][col:]], i + 1
    while j < len(lines) and lines[j].strip() and indent(lines[j]) == col and (
            not EXPLICIT.match(lines[j])):
        parts.append(lines[j].strip())
        j += 1
    return " ".join(parts).strip(), bool(bullet), col, j


def version_note(lines: list[str], i: int, pad: int, name: str, rest: str) -> int:
    """Rewrite a versionadded/versionchanged/deprecated directive as Sphinx's sentence."""
    if not rest and i + 1 < len(lines):  # the version is on the next line
        rest, lines[i + 1] = lines[i + 1].strip(), ""
    nargs = 2 if name == "deprecated-removed" else 1
    args = rest.split(None, nargs)
    label = VERSION[name].format(*args[:nargs])
    content = args[nargs] if len(args) > nargs else ""
    j = next((k for k in range(i + 1, len(lines)) if lines[k].strip()), len(lines))
    if content or j == len(lines) or indent(lines[j]) <= pad or EXPLICIT.match(lines[j]):
        lines[i] = " " * (pad + 3) + label + (f": {content}" if content else ".")
        return i
    if BULLET.match(lines[j]):  # "Changed in version X:" introduces a list
        lines[i : i + 1] = [" " * (pad + 3) + label + ":", ""]
        return i
    lines[j] = " " * indent(lines[j]) + f"{label}: {lines[j].strip()}"
    return i + 1


def directive(lines: list[str], i: int, m: re.Match[str]) -> tuple[int, int | None]:
    """Handle the directive at line i; return (next line, indent to skip beyond or None)."""
    pad, name, rest = len(m[1]), m[2], m[3].strip()
    if name in VERSION:
        return version_note(lines, i, pad, name, rest), None
    if name in KEEP and rest:  # content starts on the directive line
        lines[i] = " " * (pad + 3) + rest
        return i, None
    if name in KEEP | TITLED | OBJECT or name.startswith("c:"):
        i += 1  # then skip signature continuations and options, keep the body
        while i < len(lines) and lines[i].strip() and (
                name not in KEEP or FIELD.match(lines[i])):
            i += 1
        return i, None
    return i + 1, pad  # code, tables, index entries, toctrees, ...: drop with content


def skip_block(lines: list[str], i: int) -> int:
    """Line after the table, doctest or line block starting at line i."""
    if not SIMPLE_TABLE.match(lines[i]):
        while i < len(lines) and lines[i].strip():
            i += 1
        return i
    i += 1
    while i < len(lines) and not (SIMPLE_TABLE.match(lines[i]) and (
            i + 1 == len(lines) or not lines[i + 1].strip())):
        i += 1
    return i + 1


def parse_rst(text: str, refs: dict[str, str]) -> list[Section]:
    """Split a reST page into sections of plain-text paragraphs."""
    lines = text.expandtabs().splitlines()
    targets = re.findall(r"^\s*\.\.\s+_([^:`\n]+):", text, re.M)
    refs = refs | {t.strip().lower() + "_": "" for t in targets}  # this page's targets
    sections, items, i, skip = [Section("")], [], 0, None
    gap = ("", False)  # marks dropped content, so "...:" before it is not kept
    while i < len(lines):
        line, s = lines[i], lines[i].strip()
        if skip is not None and (not s or indent(line) > skip):
            i += 1
            continue
        skip = None
        if not s or (UNDERLINE.match(line) and not match_title(lines, i)):
            i += 1  # blank line or transition
        elif title := match_title(lines, i):
            sections[-1].paras, items = keep_paragraphs(items, refs), []
            sections.append(Section(inline(title[0], refs)))
            i += title[1]
        elif m := DIRECTIVE.match(line):
            i, skip = directive(lines, i, m)
            items += [gap] if skip is not None else []
        elif EXPLICIT.match(line) or FIELD.match(line):  # comments, targets, footnotes
            i, skip = i + 1, indent(line)
        elif s.startswith(("+-", "+=", ">>>", "|")) or SIMPLE_TABLE.match(line):
            i = skip_block(lines, i)
            items.append(gap)
        elif (b := BULLET.match(line)) and EXPLICIT.match(line[b.end() :]):
            lines[i] = " " * b.end() + line[b.end() :]
        else:
            para, is_item, col, i = read_paragraph(lines, i)
            if para.endswith("::"):  # a literal (code) block follows: drop it
                skip, para = col, re.sub(r"(\s*)::$", lambda k: "" if k[1] else ":", para)
            items += [(para, is_item)] + ([gap] if skip is not None else [])
    sections[-1].paras = keep_paragraphs(items, refs)
    return sections


def keep_paragraphs(items: list[tuple[str, bool]], refs: dict[str, str]) -> list[str]:
    """Keep prose: C4's line rules (terminal punctuation, >= 3 words), no markup left."""
    texts = [inline(raw, refs) for raw, _ in items]
    ok = [len(text.split()) >= MIN_PARA_WORDS and not DEBRIS.search(INLINE.sub(" ", raw))
          for text, (raw, _) in zip(texts, items, strict=True)]
    keep = [ok[k] and bool(TERMINAL.search(texts[k])) for k in range(len(texts))]
    for k in range(len(texts) - 2, -1, -1):  # "...:" is kept only before a kept list item
        keep[k] |= ok[k] and texts[k].endswith(":") and items[k + 1][1] and keep[k + 1]
    return [texts[k] for k in range(len(texts)) if keep[k]]


def collect_refs(pages: dict[str, str]) -> dict[str, str]:
    """Map reST labels to the titles of the sections they point at (for :ref:)."""
    refs: dict[str, str] = {}
    for text in pages.values():
        lines, pending = text.expandtabs().splitlines(), []
        for i, line in enumerate(lines):
            if m := LABEL.match(line):
                pending.append(m[1].strip().lower())
            elif title := match_title(lines, i):
                refs.update(dict.fromkeys(pending, inline(title[0], {})))
                pending = []
            elif line.strip() and not UNDERLINE.match(line) and not EXPLICIT.match(line):
                pending = []
    return refs


def pack(sections: list[Section], url: str) -> list[tuple[str, list[str]]]:
    """Group consecutive sections into documents of about MAX_DOC_WORDS at most."""
    docs: list[tuple[str, list[str]]] = []
    words, used = 0, set()
    for n, sec in enumerate(sections):
        anchor = make_id(sec.title)
        anchor = f"id{n}" if not anchor or anchor in used else anchor
        used.add(anchor)
        size = sum(len(p.split()) for p in sec.paras)
        if size and (not docs or (words + size > MAX_DOC_WORDS and words >= MIN_DOC_WORDS)):
            docs.append((f"{url}#{anchor}" if docs else url, []))
            words = 0
        if size:
            docs[-1][1].extend(sec.paras)
            words += size
    return docs


def drop_repeats(sections: list[Section], seen: set[bytes]) -> None:
    """Remove paragraphs of DEDUP_MIN_WORDS or more words already seen in the corpus."""
    for sec in sections:
        fresh = []
        for para in sec.paras:
            key = hashlib.sha1(para.lower().encode()).digest()
            if len(para.split()) < DEDUP_MIN_WORDS or key not in seen:
                fresh.append(para)
            seen.add(key)
        sec.paras = fresh


def build_documents(source: Path) -> list[dict[str, str]]:
    """Parse every page (sorted), deduplicate, and return shuffled C4-style records."""
    paths = {p.relative_to(source).as_posix().removesuffix(".rst.txt"): p
             for p in sorted(source.rglob("*.rst.txt"))}
    pages = {d: p.read_text(encoding="utf-8") for d, p in paths.items()
             if d not in SKIP_PAGES and not d.startswith("includes/")}
    refs, seen, records = collect_refs(pages), set(), []
    for page, text in pages.items():
        mtime = datetime.fromtimestamp(paths[page].stat().st_mtime, timezone.utc)
        sections = parse_rst(text, refs)
        drop_repeats(sections, seen)
        for url, paras in pack(sections, f"{BASE_URL}{page}.html"):
            doc = "\n".join(paras)
            key = hashlib.sha1(doc.encode()).digest()
            if len(doc.split()) >= MIN_DOC_WORDS and key not in seen:
                seen.add(key)
                stamp = mtime.strftime("%Y-%m-%dT%H:%M:%SZ")
                records.append({"text": doc, "timestamp": stamp, "url": url})
    random.Random(SEED).shuffle(records)
    return records


def is_validation(url: str) -> bool:
    """Deterministic ~5% validation split keyed on the URL."""
    return int(hashlib.sha256(url.encode()).hexdigest(), 16) % VALID_MOD == 0


def write_jsonl_gz(path: Path, records: list[dict[str, str]]) -> None:
    """Write records as gzip'ed JSON lines with a fixed gzip header (mtime=0)."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    with open(path, "wb") as raw, gzip.GzipFile("", "wb", 9, raw, mtime=0) as gz:
        gz.write(data)


def train_tokenizer(texts: list[str], out_dir: Path) -> None:
    """Train and save a byte-level BPE tokenizer that adds no special tokens itself."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "</s>",
              "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
              "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": int(1e30)}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def count_tokens(tokenizer_dir: Path, texts: list[str]) -> int:
    """Number of tokens in texts, without special tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))


def package_version() -> str:
    """Installed version of the Debian package, or 'unknown'."""
    cmd = ["dpkg-query", "-W", "-f=${Version}", PACKAGE]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_license(source: Path, out: Path, version: str) -> None:
    """Write LICENSE: copyright notices, changes made, and the Python licence text."""
    paras = (source / "copyright.rst.txt").read_text(encoding="utf-8").split("\n\n")
    notices = "\n".join(" ".join(p.split()) for p in paras if p.startswith("Copyright"))
    text = COPYRIGHT.read_text(encoding="utf-8")
    terms = text[text.index("Python License\n=====") : text.index("Licenses and Ackno")]
    (out / "LICENSE").write_text(LICENSE.format(
        package=PACKAGE, version=version, notices=notices, terms=terms.rstrip()) + "\n")


def main() -> None:
    """Build the corpus, the tokenizer, LICENSE and README.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=SOURCE, help="reST sources")
    parser.add_argument("--out", type=Path, default=OUT, help="output folder")
    args = parser.parse_args()
    if not (args.source / "library").is_dir() or not COPYRIGHT.is_file():
        raise SystemExit(f"error: the Python documentation sources are missing "
                         f"({args.source}); install them with:\n"
                         f"  sudo apt-get install {PACKAGE}")
    os.environ["RAYON_NUM_THREADS"] = "1"  # single-threaded, reproducible training
    records = build_documents(args.source)
    splits = {"train": [r for r in records if not is_validation(r["url"])],
              "validation": [r for r in records if is_validation(r["url"])]}
    args.out.mkdir(parents=True, exist_ok=True)
    for name, recs in splits.items():
        write_jsonl_gz(args.out / f"c4-{name}.00000-of-00001.json.gz", recs)
    train_tokenizer([r["text"] for r in splits["train"]], args.out / "tokenizer")
    rows = []
    for name, recs in splits.items():
        texts = [r["text"] for r in recs]
        ntok = count_tokens(args.out / "tokenizer", texts)
        size = (args.out / f"c4-{name}.00000-of-00001.json.gz").stat().st_size
        rows.append(f"| {name} | {len(texts):,} | {sum(map(len, texts)):,} | {ntok:,} "
                    f"| {size:,} |")
        print(rows[-1])
    version = package_version()
    write_license(args.source, args.out, version)
    (args.out / "README.md").write_text(README.format(
        package=PACKAGE, version=version, rows="\n".join(rows), vocab=VOCAB_SIZE,
        max_words=MAX_DOC_WORDS, min_words=MIN_DOC_WORDS, dedup=DEDUP_MIN_WORDS))


LICENSE = """\
Licence notices for the sample corpus in this folder
====================================================

The text in c4-train.00000-of-00001.json.gz and c4-validation.00000-of-00001.json.gz,
and the tokenizer in tokenizer/ (trained on that text), are derived from the Python 3.11
documentation, read from the Debian package {package} (version {version}).

Python and this documentation is:
{notices}

The documentation is distributed under the Python Software Foundation License
Agreement (PSF License Version 2) reproduced below, which covers Python "and its
associated documentation". The code examples in the documentation are also available
under the Zero-Clause BSD licence; no code examples are included here.

Summary of changes made (PSF License Agreement, clause 3): the reStructuredText sources
were converted to plain text by scripts/build_sample.py. Markup, headings, code examples,
tables, footnotes, and lines that are short or lack terminal punctuation were removed;
paragraphs repeated across pages were dropped; each page was split into documents of
one or more consecutive sections, and the documents were shuffled. The remaining
wording is unchanged.

The licence text below is copied verbatim from /usr/share/doc/{package}/copyright
(its "Python License" part; the rest of that file covers third-party software
incorporated in Python, not the documentation).

{terms}"""

README = """\
# Sample corpus: Python documentation prose in C4 layout

A small corpus of real English prose and a tokenizer trained on it, shipped with the
package so the harness runs end to end with no network access (`task.dataset: sample`,
`task.tokenizer: sample`). It is for tests and smoke runs, not for meaningful
pretraining results: it is a single technical domain, far smaller than C4.

## Files

| file | content |
|---|---|
| `c4-train.00000-of-00001.json.gz` | train split, gzip'ed JSON lines |
| `c4-validation.00000-of-00001.json.gz` | validation split, same format |
| `tokenizer/` | `tokenizer.json` and `tokenizer_config.json` (fast tokenizer) |
| `LICENSE` | copyright notices, changes made, and the licence text |

Each line is one document with the fields of C4 (`allenai/c4`, `en`), in C4's order:
`text` (paragraphs separated by `\\n`), `timestamp` (the source file's modification
time, `YYYY-MM-DDTHH:MM:SSZ`) and `url` (the page on docs.python.org the text comes
from, with the `#anchor` of its first section when a page is split into several
documents). The validation split holds the documents whose `sha256(url) % 20 == 0`
(about 5%); it shares no document with train.

## Size

| split | documents | characters | tokens | bytes (gzip) |
|---|---|---|---|---|
{rows}

Tokens are counted with the tokenizer below, without special tokens.

## Source and licence

- Text: the Python 3.11 documentation (https://docs.python.org/3.11/), taken from the
  reStructuredText sources in the Debian package `{package}` (version {version}),
  `/usr/share/doc/python3.11/html/_sources/`. Every page except `contents`,
  `copyright`, `license`, `whatsnew/changelog` and `includes/` is used.
- Copyright: © 2001-2023 Python Software Foundation; © 2000 BeOpen.com;
  © 1995-2000 Corporation for National Research Initiatives;
  © 1991-1995 Stichting Mathematisch Centrum. All rights reserved.
- Licence: Python Software Foundation License Agreement (PSF License Version 2),
  which allows redistribution of Python and its documentation, modified or not,
  provided the licence and copyright notice are kept and the changes summarised.
  Full text and the summary of changes: `LICENSE` in this folder (copied from
  `/usr/share/doc/{package}/copyright`; also in the documentation's "History and
  License" page).
- The tokenizer is trained on this text only and is distributed under the same terms.

## How it is made

`scripts/build_sample.py` converts each page to plain text: headings, directives
(code blocks, tables, index entries, signatures of functions and classes), literal
blocks, doctests, comments and footnotes are dropped; inline markup is replaced by the
text Sphinx would show (``:func:`len` `` becomes `len()`, ``:pep:`8` `` becomes `PEP 8`,
note and version-change boxes are kept as text). It then applies C4's line rules:
a paragraph is kept only if it ends in terminal punctuation and has at least 3 words
(a paragraph ending in a colon is kept only before a list). Paragraphs of
{dedup} or more words that already appeared earlier in the corpus are dropped.
Consecutive sections of a page are grouped into documents of at most about
{max_words} words (a single longer section stays whole); documents under
{min_words} words are dropped, and the rest are shuffled with a fixed seed.

The tokenizer is a byte-level BPE (`tokenizers` library) trained on the train split
only: vocabulary {vocab}, special tokens `<pad>` (id 0, padding), `</s>` (id 1, EOS,
also used as BOS) and `<unk>` (id 2, never produced: every byte is in the vocabulary).
It has no normalizer and no post-processor, so encoding adds no special tokens (the
packing code inserts EOS between documents) and decoding returns the text unchanged.

## Rebuilding

```
sudo apt-get install {package}
.venv/bin/python scripts/build_sample.py
```

The script is deterministic (sorted inputs, fixed seed, gzip mtime 0,
single-threaded BPE training): with the same package version and `tokenizers`
version, it rewrites every file in this folder byte for byte.
"""


if __name__ == "__main__":
    main()
