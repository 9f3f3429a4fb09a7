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
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from rst_prose import (
    DEDUP_MIN_WORDS,
    MAX_DOC_WORDS,
    MIN_DOC_WORDS,
    collect_refs,
    drop_repeats,
    pack,
    parse_rst,
)

PACKAGE = "python3.11-doc"
SOURCE = Path("/usr/share/doc/python3.11/html/_sources")
COPYRIGHT = Path(f"/usr/share/doc/{PACKAGE}/copyright")
OUT = Path(__file__).resolve().parent.parent / "harness" / "data" / "sample"
BASE_URL = "https://docs.python.org/3.11/"
SKIP_PAGES = {"contents", "copyright", "license", "whatsnew/changelog"}  # no prose / legal
VALID_MOD, VOCAB_SIZE, SEED = 20, 8192, 0  # validation: sha256(url) % 20 == 0, ~5%
SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]  # ids 0, 1 (EOS), 2


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
