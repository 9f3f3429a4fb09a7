"""The docs check: what README.md and docs/*.md show must stay true of the code.

Every `harness ...` command they show (fenced shell blocks, inline code, table cells) is parsed
by the real CLI parser with placeholders (RUNS_DIR, N, KEY=VALUE, ...) filled in; every
(command, flag) pair they show is run by some test under tests/; the cheap read-only commands
(methods, plan, estimate, sweep --dry-run, --help) run here and must exit 0; a flag quoted on
its own is some command's; the README stays within 12 KB; and the room table of
docs/architecture.md names every module file of every room. A failure names the doc's
file:line and the command as written there.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO

from harness.cli import build_parser, main

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PLACEHOLDERS = {  # a metavariable as the docs write it -> a value the parser and a run accept
    "RUNS_DIR": "runs/quickstart", "SWEEP.yaml": "sweeps/quickstart.yaml",
    "RUN.yaml": "sweeps/train_tiny.yaml", "DIR": "runs/docs_check", "N": "4", "STEPS": "3",
    "SECONDS": "5", "KEY=VALUE": "train.steps=4", "MODEL": "llama_7b", "NAME": "t5-base",
    "RANK:MICRO": "64:1", "<command>": "train", "TRIAL_DIR": "runs/quickstart/trials/t0",
}  # fmt: skip
# Shown pairs that no test runs, each with the reason it cannot run here (none today).
UNTESTED: dict[tuple[str, str], str] = {}
FOREIGN = {  # flags the docs quote from other programs, not harness's
    "--beta2": "Q-GaLore's run_pretrain.py", "--simulation": "Q-GaLore's run_pretrain.py",
    "--dtype": "GaLore's torchrun_main.py", "--optimizer": "GaLore's torchrun_main.py",
    "--bf16": "ReLoRA's torchrun_main.py", "--signal": "sbatch", "--durations": "pytest",
}  # fmt: skip
CHEAP = {"methods", "plan", "estimate"}  # read-only and seconds here: run for real
OPEN, CLOSE, ALT, END = "\0[", "\0]", "\0|", "\0;"  # operators; "\1" joins a word's alternatives
SHELL = {"", "bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Shown:
    """One expansion of one command a doc shows: `argv` is what follows `harness`."""

    where: str  # "docs/sweeps.md:8"
    text: str  # as the doc writes it
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: `{self.text}`"


def tokenize(text: str) -> list[str]:
    """Shell words (quotes removed) and operators: `[`/`]` of an optional part; `\\|` spaced
    out or a bare `|` inside brackets (an alternative); `|`, `&&`, `;` outside them (the end of
    a command); `#` at a word's start ends the line. `a\\|b` is one word of alternatives."""
    out, word, depth, i = [], "", 0, 0
    while i < len(text):
        c = text[i]
        if c in "'\"" and c in text[i + 1:]:
            end = text.index(c, i + 1)
            word, i = word + text[i + 1:end], end + 1
            continue
        if text.startswith("\\|", i):
            if word:
                word += "\1"
            else:
                out.append(ALT)
            i += 2
            continue
        special = (c.isspace() or (c == "[" and not word) or (c == "]" and depth)
                   or c in "|;" or text.startswith("&&", i) or (c == "#" and not word))
        if not special:
            word, i = word + c, i + 1
            continue
        if word:
            out.append(word)
            word = ""
        if c == "#":
            break
        if c == "[":
            out.append(OPEN)
            depth += 1
        elif c == "]":
            out.append(CLOSE)
            depth -= 1
        elif c == "|":
            out.append(ALT if depth else END)
        elif c in ";&":
            out.append(END)
            i += c == "&"
        i += 1
    return [*out, word] if word else out


def expand(tokens: list[str], pos: int = 0) -> tuple[list[list[str]], int]:
    """Every reading of a sequence up to its `]`: each optional part included, each
    alternative taken in turn (the fullest commands the docs show)."""
    choices: list[list[str]] = []
    items: list[list[list[str]]] = []
    while pos < len(tokens) and tokens[pos] != CLOSE:
        token = tokens[pos]
        if token == ALT:
            choices += readings(items)
            items, pos = [], pos + 1
        elif token == OPEN:
            inner, pos = expand(tokens, pos + 1)
            items.append(inner)
            pos += 1  # its CLOSE
        else:
            items.append([[w] for w in token.split("\1")])
            pos += 1
    return choices + readings(items), pos


def readings(items: list[list[list[str]]]) -> list[list[str]]:
    """Each item's readings in turn: one word list per combination."""
    return [[w for part in parts for w in part] for parts in itertools.product(*items)]


def commands(text: str) -> list[list[str]]:
    """The `harness` commands in a shell text, each expanded, without the word `harness`;
    `$`, `time` and environment assignments before it, and `python -m harness.cli` or
    `torchrun ... -m harness.cli`, count."""
    found, segment = [], []
    for token in [*tokenize(text), END]:
        if token != END:
            segment.append(token)
            continue
        for k, word in enumerate(segment):
            cli = word == "harness.cli" and k > 0 and segment[k - 1] == "-m"
            if cli or (word == "harness" and all(
                    w in ("$", "time") or re.fullmatch(r"[A-Z_]+=\S*", w) for w in segment[:k])):
                found += expand(segment[k + 1:])[0]
                break
        segment = []
    return found


def snippets(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each fenced shell line (continuations joined) and each inline code span
    that starts with `harness`."""
    lines, out, fence, prose = path.read_text().split("\n"), [], None, []
    pending: tuple[int, str] | None = None
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fence = None if fence is not None else line.strip("` ").split(" ")[0]
            prose.append("")
            continue
        if fence is None:
            prose.append(line)
            continue
        prose.append("")
        if fence in SHELL:
            start, text = pending or (n, "")
            text += line.rstrip("\\") + " "
            pending = (start, text) if line.endswith("\\") else None
            if pending is None:
                out.append((start, " ".join(text.split())))
    number = 0
    for paragraph in re.split(r"(\n[ \t]*\n)", "\n".join(prose)):
        for span in re.finditer(r"(`+)(.+?)\1", paragraph, re.DOTALL):
            code = " ".join(span.group(2).split())
            if re.match(r"(time )?harness\s|\S*torchrun .*-m harness\.cli ", code):
                out.append((number + paragraph.count("\n", 0, span.start()) + 1, code))
        number += paragraph.count("\n")
    return out


def shown() -> list[Shown]:
    """Every expansion of every command README.md and docs/*.md show, with where it is."""
    out = []
    for path in DOCS:
        for line, text in snippets(path):
            where = f"{path.relative_to(REPO)}:{line}"
            out += [Shown(where, text, tuple(argv)) for argv in commands(text)]
    return out


SHOWN = shown()
PARSER = build_parser()
SUBCOMMANDS = next(a for a in PARSER._actions if a.choices and "train" in a.choices).choices


def parser_of(argv: tuple[str, ...]) -> argparse.ArgumentParser | None:
    """The subparser of the command (a placeholder filled), or the top-level parser."""
    if not argv or argv[0].startswith("-"):
        return PARSER
    return SUBCOMMANDS.get(PLACEHOLDERS.get(argv[0], argv[0]))


def filled(item: Shown) -> list[str]:
    """argv with placeholders filled; `FLAG ...` (a value left out) gets the flag's metavar's
    placeholder, any other `...` (repeat the last) is dropped."""
    parser, out = parser_of(item.argv), []
    for prev, word in zip(("", *item.argv), item.argv, strict=False):
        if word == "...":
            known = parser is not None and prev.startswith("-")
            action = parser._option_string_actions.get(prev) if known else None
            if action is not None:
                out.append(PLACEHOLDERS.get(action.metavar or "", "x"))
            continue
        out.append(PLACEHOLDERS.get(word, word))
    return out


def parse(argv: list[str]) -> tuple[int | None, str]:
    """The real parser on argv: (None, "") when it parses, else its exit code and message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            PARSER.parse_args(argv)
    except SystemExit as stop:
        return int(stop.code or 0), err.getvalue().strip()
    return None, ""


def problem(item: Shown) -> str | None:
    """Why the real parser refuses the command, or None. A fragment that only leaves out a
    required argument (`harness status --json`) or names a flag without its value as the last
    word (`harness plan --memory`) is a reference, not a command, and passes."""
    parser = parser_of(item.argv)
    if parser is None:
        return f"no subcommand '{item.argv[0]}' (harness has {', '.join(SUBCOMMANDS)})"
    argv = filled(item)
    unknown = [w for w in argv if re.fullmatch(r"[A-Z][A-Z0-9_]*([.:=][A-Za-z_]+)?|<\w+>", w)]
    if unknown:
        return f"placeholder {unknown[0]} has no value in PLACEHOLDERS (tests/test_docs.py)"
    for word in argv:
        flag = word.split("=")[0]
        if word.startswith("-") and flag not in parser._option_string_actions:
            return f"'{parser.prog}' has no flag {flag}"
    code, message = parse(argv)
    if not code or "the following arguments are required" in message:
        return None
    if f"argument {argv[-1]}: expected one argument" in message:
        return None
    return message


def test_every_command_the_docs_show_parses() -> None:
    assert len(SHOWN) > 50 and {i.argv[0] for i in SHOWN} >= set(SUBCOMMANDS), "extraction broke"
    bad = [f"{item} -> {why}" for item in SHOWN if (why := problem(item))]
    assert not bad, "commands in the docs the CLI refuses:\n" + "\n".join(bad)


def pairs() -> dict[tuple[str, str], Shown]:
    """(command, flag) -> where the docs first show it; the command is `bench WHAT` for bench,
    and the flag '' stands for the command itself."""
    out: dict[tuple[str, str], Shown] = {}
    for item in SHOWN:
        argv = filled(item)
        if not argv or argv[0].startswith("-") or "--help" in argv:
            continue
        command = " ".join(argv[:2]) if argv[0] == "bench" and len(argv) > 1 else argv[0]
        for flag in ["", *(w.split("=")[0] for w in argv if w.startswith("--"))]:
            out.setdefault((command, flag), item)
    return out


def strings_in_tests() -> list[tuple[str, ...]]:
    """The string constants of each call and list in tests/ (this file aside), in order."""
    out = []
    for path in (REPO / "tests").rglob("*.py"):
        if path.resolve() == Path(__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call | ast.List | ast.Tuple):
                items = node.args if isinstance(node, ast.Call) else node.elts
                out.append(tuple(i.value for i in items
                                 if isinstance(i, ast.Constant) and isinstance(i.value, str)))
    return out


def runs(strings: tuple[str, ...], command: list[str], flag: str) -> bool:
    """Whether a call or list runs `harness COMMAND ... FLAG`: its strings start with the
    command's words (`main(["bench", "memory", ...])`, `harness("sweep", ...)`) or have them
    right after "harness.cli" (`python -m harness.cli train ...`), and the flag follows."""
    starts = [0, *(i + 1 for i, s in enumerate(strings) if s == "harness.cli")]
    return any(list(strings[i:i + len(command)]) == command
               and (not flag or flag in strings[i + len(command):]) for i in starts)


def test_every_command_and_flag_the_docs_show_is_run_by_a_test() -> None:
    calls, shown_pairs = strings_in_tests(), pairs()
    assert len(shown_pairs) > 30, "extraction broke"
    missing = [f"{item} -> harness {command} {flag}".rstrip()
               for (command, flag), item in shown_pairs.items()
               if (command, flag) not in UNTESTED
               and not any(runs(strings, command.split(), flag) for strings in calls)]
    assert not missing, ("shown in the docs, run by no test under tests/ (write one, or say "
                         "why it cannot run in UNTESTED):\n" + "\n".join(missing))
    stale = set(UNTESTED) - set(shown_pairs)
    assert not stale, f"UNTESTED names pairs the docs no longer show: {stale}"


def runnable() -> list[Shown]:
    """The cheap, read-only commands among those shown, whole (not fragments), each once."""
    seen, out = set(), []
    for item in SHOWN:
        argv = filled(item)
        cheap = argv and (argv[0] in CHEAP or "--help" in argv
                          or (argv[0] == "sweep" and "--dry-run" in argv))
        if cheap and tuple(argv) not in seen and not parse(argv)[0]:
            seen.add(tuple(argv))
            out.append(item)
    return out


@pytest.mark.parametrize("item", runnable(), ids=lambda i: f"{i.where} {' '.join(i.argv)}")
def test_the_cheap_commands_the_docs_show_exit_0(item: Shown, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    monkeypatch.chdir(REPO)  # the docs' paths are the repository's
    if "RUNS_DIR" in item.argv:  # `plan --from RUNS_DIR` reads one: an empty sweep's
        (tmp_path / "runs" / "trials").mkdir(parents=True)
        monkeypatch.setitem(PLACEHOLDERS, "RUNS_DIR", str(tmp_path / "runs"))
    try:
        code = main(filled(item))
    except SystemExit as stop:  # --help
        code = stop.code
    assert code == 0, f"{item} exited {code}: {capsys.readouterr().err[-2000:]}"


def test_every_flag_quoted_alone_is_a_harness_flag() -> None:
    """A flag the prose quotes on its own (`--retry-failed`, `--jobs N`) exists in some
    harness command, unless FOREIGN says whose it is."""
    flags = {f for p in (PARSER, *SUBCOMMANDS.values()) for f in p._option_string_actions}
    bad = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"`(--[a-z][a-z0-9-]*)(?:[ =][^`]*)?`", text):
            if m.group(1) not in flags and m.group(1) not in FOREIGN:
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{path.relative_to(REPO)}:{line}: {m.group(0)}")
    assert not bad, "flags no harness command has (another program's? add it to FOREIGN):\n" + (
        "\n".join(bad))


def test_the_readme_stays_the_front_door() -> None:
    """README.md is the front door, at most 12 KB; the reference pages hold the rest."""
    size = len((REPO / "README.md").read_bytes())
    assert size <= 12 * 1024, f"README.md is {size:,} bytes: move detail to docs/, keep 12 KB"


def test_the_room_table_names_every_module_file() -> None:
    """docs/architecture.md's room table has a row for each room, and each room's row names
    each module of its folder (a new file gets its words there) and no file that is gone."""
    doc = REPO / "docs" / "architecture.md"
    bad, folders = [], set()
    for n, row in enumerate(doc.read_text().split("\n"), 1):
        cells = [c.strip() for c in row.strip().strip("|").split(" | ")]
        folder = re.fullmatch(r"`([\w/]+/)`.*", cells[1]) if len(cells) == 3 else None
        if folder is None:
            continue
        folders.add(folder.group(1))
        named = set(re.findall(r"`(\w+\.py)`", cells[2]))
        there = {p.name for p in (REPO / folder.group(1)).glob("*.py")} - {"__init__.py"}
        bad += [f"docs/architecture.md:{n}: room {cells[0]} does not name {folder.group(1)}{f}"
                for f in sorted(there - named)]
        bad += [f"docs/architecture.md:{n}: room {cells[0]} names {f}, not in {folder.group(1)}"
                for f in sorted(named - there)]
    inits = [*REPO.glob("harness/**/__init__.py"), *REPO.glob("*/__init__.py")]
    packages = {f"{p.parent.relative_to(REPO)}/" for p in inits
                if p.parent.name not in ("harness", "tests")}
    bad += [f"docs/architecture.md: no room row for {p}" for p in sorted(packages - folders)]
    assert not bad, "\n".join(bad)
