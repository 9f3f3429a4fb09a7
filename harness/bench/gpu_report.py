"""gpu.md from gpu.json: one section per part, tables in docs/benchmarks.md's form, each part
saying the machine, versions and command that measured it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.bench.memory import met

Record = dict[str, Any]
TITLES = {
    "tests": "`pytest -m gpu`: every method × modifier × precision on the device",
    "estimate": "Estimate against the measured bytes and steady-step peak, every method",
    "table11": "GaLore Table 11: LLaMA-1B, token batch 256, bf16-true",
    "mfu": "MFU at LLaMA-1B, 64 × 256, bf16-true: each speed lever, the best, the methods",
    "loop": "`harness bench loop`: the harness's loop against a bare PyTorch loop",
    "llama7b": "LLaMA-7B optimizer steps, bf16-true, 1 × 256 tokens",
}


def _gb(value: Any) -> str:
    return "" if value is None else f"{value / 1e9:.2f}"


def _num(value: Any, spec: str = ",.0f") -> str:
    return "" if value is None else format(value, spec)


def _yes(ok: Any) -> str:
    return "" if ok is None else ("yes" if ok else "**no**")


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    return [f"| {' | '.join(headers)} |", f"|{'---|' * len(headers)}",
            *(f"| {' | '.join(row)} |" for row in rows)]


def _tests(records: list[Record]) -> list[str]:
    """pytest's summary; without one (the part was killed at its cap), the outcomes each test
    recorded as it ended."""
    lines = []
    for r in records:
        if r["name"] == "gpu/tests" and "value" in r:
            lines.append(f"passed {r['value']}, failed {r['failed']}, skipped {r['skipped']}")
            lines += [f"- {failure}" for failure in r["failures"]]
        elif r["name"] == "gpu/tests":
            lines.append(f"no pytest report; its output ends: {r.get('error', '')[-500:]}")
    if lines:
        return lines
    ended = [r for r in records if r["name"].startswith("gpu/test/")]
    counts = {o: sum(r["outcome"] == o for r in ended) for o in ("passed", "failed", "skipped")}
    lines.append(f"cut off at the cap after {len(ended)} outcomes: "
                 + ", ".join(f"{o} {n}" for o, n in counts.items()))
    return lines + [f"- {r['name'].removeprefix('gpu/test/')} ({r['when']}): {r['message']}"
                    for r in ended if r["outcome"] == "failed"]


def _estimate(records: list[Record]) -> list[str]:
    rows = [[r["name"].removeprefix("gpu/memory/"), _num(r.get("value")),
             _num(r.get("estimate")), _num(r.get("ratio"), ".4f"),
             f"1 ± {r['tolerance']}" if "tolerance" in r else "exact",
             _yes(met(r)) if "value" in r else r.get("status", "")] for r in records]
    return _table(["record", "measured", "estimated", "ratio", "target", "met?"], rows)


def _table11(records: list[Record]) -> list[str]:
    return _table(
        ["configuration", "peak GB", "estimate GB", "paper GB", "tok/s", "paper tok/s", "MFU"],
        [[r["name"].rsplit("/", 1)[1], _gb(r.get("peak_bytes")) or r["status"],
          _gb(r.get("estimate_peak_bytes")), _num(r.get("paper_gb"), ".2f"),
          _num(r.get("tokens_per_s")), _num(r.get("paper_tokens_per_s")),
          _num(r.get("mfu"), ".1%")] for r in records])  # fmt: skip


def _mfu(records: list[Record]) -> list[str]:
    """The GEMM probe; the runs (baseline, each lever alone, the best combinations, the methods
    with the best levers, 32-true with and without TF32); the best against their targets."""
    runs = [r for r in records if "/gemm/" not in r["name"]]
    lines = _table(["run", "levers", "tok/s", "MFU", "ms/step", "peak GB", "speed-up"],
                   [[r["name"].split("/", 3)[3], ", ".join(r["levers"]) or "none",
                     _num(r.get("tokens_per_s")), _num(r.get("mfu"), ".1%"),
                     _num(r.get("ms_per_step"), ",.1f"), _gb(r.get("peak_bytes")) or r["status"],
                     _speedup(r)] for r in runs])  # fmt: skip
    refused = [r for r in runs if r["status"] == "refused"]
    lines += [f"- {r['name'].split('/', 3)[3]}: refused: {r['error']}" for r in refused]
    for r in runs:
        if "target" not in r:
            continue
        width = "the MLP padded to a multiple of 64" if "padded" in r["name"] else (
            "the paper's MLP width")
        verdict = ("no peak FLOP/s is known for this device (harness/cost/meter.py)"
                   if r["met"] is None else "met" if r["met"] else "missed")
        lines += ["", f"Best at {width}: MFU {_num(r.get('mfu'), '.1%') or '–'}, target ≥ "
                      f"{r['target']:.0%}: {verdict}."]
    gemms = [r for r in records if "/gemm/" in r["name"]]
    if gemms:
        peak = gemms[0]["peak_tflops"]
        lines += ["", f"Each matmul alone at {gemms[0]['tokens']:,} tokens, bf16, TFLOP/s "
                      f"(the device's peak: {_num(peak) or 'unknown'}):", ""]
        lines += _table(["weight (out × in)", "rounded up from", "forward", "input grad",
                         "weight grad"],
                        [[f"{r['out']} × {r['in']}",
                          " × ".join(map(str, r["padded_from"])) if r["padded_from"] else "",
                          *(_num(r["tflops"][k], ",.4g")
                            for k in ("forward", "input_grad", "weight_grad"))]
                         for r in gemms])  # fmt: skip
    return lines


def _speedup(r: Record) -> str:
    """Over the baseline (full AdamW's runs), or over full AdamW's best (the methods')."""
    if "ratio_to_full" in r:
        return f"{r['ratio_to_full']:.2f}× full's best"
    return _num(r.get("speedup"), ".2f") + ("×" if "speedup" in r else "")


def _loop(records: list[Record]) -> list[str]:
    lines = []
    for r in records:
        lines += _table(["round", "harness tok/s", "bare tok/s", "ratio"],
                        [[str(x["round"]), _num(x["harness_tok_s"]), _num(x["bare_tok_s"]),
                          f"{x['ratio']:.3f}"] for x in r["rounds"]])
        lines += ["", f"{r['name']}: median ratio {r['value']:.3f}, target ≥ {r['target']}: "
                      f"{'met' if r['met'] else 'missed'}."]
    return lines


def _llama7b(records: list[Record]) -> list[str]:
    rows = [[r["name"].rsplit("/", 1)[1], _gb(r.get("peak_bytes")) or r["status"],
             _gb(r.get("estimate_peak_bytes")), _num(r.get("ratio"), ".3f"), _yes(r.get("met")),
             _num(r.get("paper_gb"), ".2f"), _gb(r.get("estimate_at_paper_vocab_bytes")),
             r.get("paper_source", "")] for r in records]
    return _table(["configuration", "peak GB", "estimate GB", "ratio", "within 5%?",
                   "paper GB", "estimate at 32K vocab GB", "paper's figure"], rows)


SECTIONS: dict[str, Callable[[list[Record]], list[str]]] = {
    "tests": _tests, "estimate": _estimate, "table11": _table11, "mfu": _mfu, "loop": _loop,
    "llama7b": _llama7b,
}


def _machine(env: dict[str, Any]) -> str:
    gpu = env.get("gpu") or "CPU (smoke: not GPU figures)"
    return (f"{gpu}, driver {env.get('driver')}, {env.get('gpu_memory')}; CUDA {env.get('cuda')}, "
            f"torch {env.get('torch')}, bitsandbytes {env.get('bitsandbytes')}, transformers "
            f"{env.get('transformers')}; {env.get('date')}; `{env.get('command')}`")


def render(state: dict[str, Any]) -> str:
    lines = ["# `harness bench gpu`", ""]
    if state.get("environment"):
        lines += [f"Latest run: {_machine(state['environment'])}", ""]
    for name, title in TITLES.items():
        part = state["parts"].get(name)
        lines += [f"## {name}: {title}", ""]
        if part is None:
            lines += ["Not run yet.", ""]
            continue
        lines += [f"{part['status']} in {part['seconds']:g} s (cap {part['cap_s']:g} s) on "
                  f"{_machine(part['environment'])}", ""]
        lines += [*SECTIONS[name](part["records"]), ""]
        if part.get("error"):
            lines += ["Output's end:", "", "```", part["error"].strip()[-1500:], "```", ""]
    return "\n".join(lines)
