"""reStructuredText to plain English paragraphs, for the sample corpus (see build_sample.py).

Keeps prose and admonitions, turns version notes and roles into words, and drops code,
tables, field lists and lines that are too short or unpunctuated to be sentences, as C4 does.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass, field

MIN_DOC_WORDS, MAX_DOC_WORDS, DEDUP_MIN_WORDS, MIN_PARA_WORDS = 100, 1200, 12, 3
SUBSTITUTIONS = {"version": "3.11", "release": "3.11.2"}


@dataclass
class Section:
    """A titled run of plain-text paragraphs from one page."""

    title: str
    paras: list[str] = field(default_factory=list)


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
