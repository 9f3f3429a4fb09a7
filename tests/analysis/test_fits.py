"""The power-law fits, the speedup over tuned AdamW and the scaling fits, on synthetic numbers
whose answers are known by hand."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.analysis.budgets import best_sets
from harness.analysis.fit_figures import scaling_figure
from harness.analysis.fits import fit_power_law
from harness.analysis.html import Paragraph
from harness.analysis.protocol import protocol_sections
from harness.analysis.scaling import gap_at_7b, scaling, scaling_table
from harness.analysis.speedup import FLOOR_NOTE, speedup_table, speedups
from harness.errors import UserError

T_975_1 = 12.7062047  # Student's t, 97.5% quantile, 1 degree of freedom (two seeds), tables


def _exact(D: np.ndarray, E: float, A: float, alpha: float) -> np.ndarray:
    return E + A * D**-alpha


def test_fit_recovers_an_exact_law() -> None:
    D = 1e6 * 2.0 ** np.arange(6)
    law = fit_power_law(D, _exact(D, 2.0, 400.0, 0.3))
    assert (law.E, law.A, law.alpha) == pytest.approx((2.0, 400.0, 0.3), rel=1e-6)
    # Exactly three points: still exact, and no error without seeds or residual freedom.
    three = fit_power_law(D[:3], _exact(D[:3], 2.0, 400.0, 0.3))
    assert (three.E, three.A, three.alpha) == pytest.approx((2.0, 400.0, 0.3), rel=1e-6)
    assert all(math.isnan(e) for e in three.errors)


def test_the_inverse_is_the_tokens_the_law_needs() -> None:
    # L(D) = 1 + 100·D^−0.5: L(10,000) = 1 + 100/100 = 2; L = 3 needs D = (100/2)^2 = 2,500.
    D = np.array([1e2, 1e3, 1e4, 1e5])
    law = fit_power_law(D, _exact(D, 1.0, 100.0, 0.5))
    assert float(law.loss(1e4)) == pytest.approx(2.0, rel=1e-6)
    assert law.inverse(3.0) == pytest.approx(2500.0, rel=1e-6)
    assert law.inverse(law.E) == law.inverse(0.999) == math.inf  # at or below the floor


def test_noisy_fits_scatter_as_their_errors_say() -> None:
    """100 draws of noise σ = 0.01 on six budgets. Measured over 300 draws (three seeds): the
    means' bias stayed within 1.1 standard errors, and the median reported error was 0.96-1.10
    times the parameters' spread over draws."""
    D = 1e6 * 2.0 ** np.arange(6)
    truth = np.array([2.0, 400.0, 0.3])
    clean = _exact(D, *truth)
    rng = np.random.default_rng(0)
    laws = [fit_power_law(D, clean + rng.normal(0, 0.01, len(D)), sigma=np.full(len(D), 0.01))
            for _ in range(100)]
    fitted = np.array([(law.E, law.A, law.alpha) for law in laws])
    spread = fitted.std(axis=0, ddof=1)
    assert np.all(np.abs(fitted.mean(axis=0) - truth) < 3 * spread / np.sqrt(len(laws)))
    reported = np.median([(law.errors[0], law.errors[2]) for law in laws], axis=0)
    assert np.all((reported / spread[[0, 2]] > 0.8) & (reported / spread[[0, 2]] < 1.25))


def test_a_law_without_floor_through_two_points() -> None:
    # L = A·N^−α through (1e7, 4) and (1e8, 4·10^−0.1): α = 0.1, A = 4·(1e7)^0.1 = 4·10^0.7.
    law = fit_power_law([1e7, 1e8], [4.0, 4.0 * 10**-0.1], floor=False)
    assert (law.A, law.alpha) == pytest.approx((4.0 * 10**0.7, 0.1), rel=1e-6)
    assert law.E == 0.0


@pytest.mark.parametrize(("points", "floor", "need"), [(2, True, 3), (1, False, 2)])
def test_a_fit_of_too_few_points_is_one_line(points: int, floor: bool, need: int) -> None:
    with pytest.raises(UserError, match=f"needs at least {need} distinct points; got {points}"):
        fit_power_law([1e6, 2e6][:points], [3.0, 2.9][:points], floor=floor)


# AdamW's law in these tests: L(D) = 2 + 1000·D^−0.5, exact at each budget.
BUDGETS = (1e6, 2e6, 4e6, 8e6)


def _adamw(D: float) -> float:
    return 2.0 + 1000.0 / math.sqrt(D)


def _trial(method: str, D: float, loss: float, lr: float = 1e-3, seed: int = 0,
           status: str = "ok", model: str = "tiny", params: float = 1e7) -> dict:
    return {"method": method, "memory": None, "precision": None, "model": model, "lr": lr,
            "seed": seed, "status": status, "tokens": D, "eval_loss": loss,
            "total_params": params}


def _sweep(budgets: tuple[float, ...] = BUDGETS) -> pd.DataFrame:
    """AdamW on its law (and a worse LR); `fast` reaching at D what AdamW reaches at 2D (two
    seeds ±0.01 at 1M tokens), a worse LR and a failed trial beside it; `floor` below E."""
    rows = []
    for D in budgets:
        rows += [_trial("full", D, _adamw(D)), _trial("full", D, _adamw(D) + 0.3, lr=1e-2),
                 _trial("fast", D, _adamw(2 * D) - 0.01), _trial("fast", D, _adamw(2 * D) + 0.01,
                                                                 seed=1),
                 _trial("fast", D, _adamw(2 * D) + 0.2, lr=1e-2),
                 _trial("fast", D, 0.5, lr=3e-2, status="nan"),
                 _trial("floor", D, 1.9)]
    return pd.DataFrame(rows)


def test_a_method_at_adamws_loss_at_twice_the_tokens_has_speedup_two() -> None:
    result = speedups(_sweep())
    points = result.points.set_index(["variant", "tokens"])
    for D in BUDGETS:
        assert points.loc[("fast", D), "speedup"] == pytest.approx(2.0, rel=1e-6)
        assert points.loc[("fast", D), "tokens_adamw"] == pytest.approx(2 * D, rel=1e-6)
        assert points.loc[("fast", D), "lr"] == 1e-3  # its best LR, not the failed trial's
        assert points.loc[("full", D), "speedup"] == pytest.approx(1.0, rel=1e-6)
    assert points.loc[("fast", 8e6), "note"].startswith("extrapolated: past AdamW's largest")
    assert points.loc[("fast", 1e6), "note"] == ""
    law = result.fits["tiny"]
    assert (law.E, law.A, law.alpha) == pytest.approx((2.0, 1000.0, 0.5), rel=1e-6)


def test_the_speedup_interval_maps_the_seeds_t_interval_through_adamws_law() -> None:
    # Seeds 2.7071 ± 0.01 (L(2M)): mean L(2M), half-width t·s/√2 = 12.7062·0.01; each end read
    # off D = (1000/(L − 2))², over the 1M tokens used.
    half = T_975_1 * 0.01
    mean = _adamw(2e6)
    row = speedups(_sweep()).points.set_index(["variant", "tokens"]).loc[("fast", 1e6)]
    assert row["ci"] == pytest.approx(half, rel=1e-6)
    assert row["low"] == pytest.approx((1000 / (mean + half - 2)) ** 2 / 1e6, rel=1e-6)
    assert row["high"] == pytest.approx((1000 / (mean - half - 2)) ** 2 / 1e6, rel=1e-6)


def test_a_loss_below_adamws_floor_gets_no_number() -> None:
    result = speedups(_sweep())
    table = speedup_table(result)
    floor = table[table["method"] == "floor"]
    assert len(floor) == len(BUDGETS)
    assert (floor["note"] == FLOOR_NOTE).all()
    assert (floor["speedup"] == "").all() and (floor["AdamW tokens"] == "").all()


def test_an_interval_reaching_the_floor_is_open_above() -> None:
    # Seeds 2.05 ± 0.01 at 1M tokens: speedup (1000/0.05)²/1M = 400; the lower loss bound
    # 2.05 − 12.7062·0.01 is below E = 2, so the interval is [(1000/0.177062)²/1M, ∞).
    trials = pd.DataFrame([_trial("full", D, _adamw(D)) for D in BUDGETS]
                          + [_trial("near", 1e6, 2.04), _trial("near", 1e6, 2.06, seed=1)])
    result = speedups(trials)
    row = result.points.set_index("variant").loc["near"]
    assert row["speedup"] == pytest.approx(400.0, rel=1e-6)
    assert row["high"] == math.inf
    assert row["low"] == pytest.approx((1000 / (0.05 + T_975_1 * 0.01)) ** 2 / 1e6, rel=1e-6)
    cells = speedup_table(result).set_index("method").loc["near"]
    assert cells["95% interval"] == "[31.90, ∞)" and cells["speedup"] == "400.00"


def test_losses_that_do_not_fall_get_a_line_not_a_law() -> None:
    trials = pd.DataFrame([_trial("full", D, 3.0 + D / 1e8) for D in BUDGETS])
    result = speedups(trials)
    assert result.fits == {} and result.points.empty
    assert result.missing[0].startswith(
        "tiny: no speedup: AdamW (`full`): the losses (3.01, 3.02, 3.04, 3.08) do not fall as "
        "a power law")


def test_too_few_budgets_is_one_line_naming_what_is_missing() -> None:
    result = speedups(_sweep(BUDGETS[:2]))
    assert result.fits == {} and result.points.empty
    assert result.missing == [
        "tiny: no speedup: AdamW (`full`) finished at 2 token budget(s) (1,000,000, 2,000,000); "
        "its fit L(D) = E + A·D^−α needs 3."]


def test_the_baseline_is_a_parameter() -> None:
    sweep = _sweep().replace({"method": {"full": "adamw"}})
    result = speedups(sweep)
    assert result.fits == {}  # no `full`: nothing to fit, and the line says there is none
    assert result.missing == ["tiny: no speedup: AdamW (`full`) has no finished trial; "
                              "its fit L(D) = E + A·D^−α needs 3."]
    points = speedups(sweep, baseline="adamw").points.set_index(["variant", "tokens"])
    assert points.loc[("fast", 2e6), "speedup"] == pytest.approx(2.0, rel=1e-6)


def test_a_recorded_budget_groups_trials_and_their_tokens_are_d() -> None:
    # Two methods at one recorded budget of 1,000 tokens, trained 960 (whole steps) and 960.
    trials = pd.DataFrame([_trial("full", 960, 3.0), _trial("galore", 960, 3.1)])
    sets = best_sets(trials.assign(budget_tokens=1000))
    assert set(sets["budget"]) == {1000} and set(sets["tokens"]) == {960}
    assert sets["chinchilla"].isna().all()  # a budget in tokens


def test_a_chinchilla_budget_is_named_by_its_multiple() -> None:
    sweep = _sweep()
    multiple = {1e6: 1, 2e6: 2, 4e6: 4, 8e6: 8}
    multiples = sweep.assign(chinchilla=sweep["tokens"].map(multiple))
    table = speedup_table(speedups(multiples)).set_index(["method", "tokens"])
    assert table.loc[("fast", "2,000,000"), "budget"] == "2× Chinchilla"
    assert table.loc[("fast", "2,000,000"), "speedup"] == "2.00"


# Scaling: AdamW on L(N) = 1.5 + 300·N^−0.25 at four sizes; `g` on 10·N^−0.05 at two.
SIZES = {"s1": 1e7, "s2": 3e7, "s3": 1e8, "s4": 3e8}


def _scaling_sweep() -> pd.DataFrame:
    rows = []
    for model, N in SIZES.items():
        rows.append(_trial("full", 4e6, 1.5 + 300 * N**-0.25, model=model, params=N))
        rows.append(_trial("full", 1e6, 9.0, model=model, params=N))  # not its largest budget
        if model in ("s1", "s3"):
            rows.append(_trial("g", 4e6, 10 * N**-0.05, model=model, params=N))
    return pd.DataFrame(rows)


def test_scaling_fits_each_method_and_extrapolates_to_7b() -> None:
    result = scaling(_scaling_sweep())
    full, g = result.fits["full"], result.fits["g"]
    assert full.floor and (full.E, full.A, full.alpha) == pytest.approx((1.5, 300, 0.25),
                                                                         rel=1e-5)
    assert not g.floor and (g.A, g.alpha) == pytest.approx((10, 0.05), rel=1e-6)
    # At 6.74e9: AdamW 1.5 + 300/6.74e9^0.25 = 1.5 + 300/286.527 = 2.54702; g 10/6.74e9^0.05
    # = 10/3.10051 = 3.22528; the gap 0.67826.
    assert gap_at_7b(result)["g"] == pytest.approx(3.22528 - 2.54702, abs=1e-4)
    points = result.points.set_index(["variant", "model"])
    assert points.loc[("full", "s2"), "compute"] == 6 * 3e7 * 4e6  # its largest budget's D
    table = scaling_table(result).set_index("method")
    assert table.loc["g", "gap to AdamW at 7B (extrapolated)"] == "+0.678"


def test_the_7b_extrapolation_is_drawn_dashed_and_labelled() -> None:
    figure, caption = scaling_figure(scaling(_scaling_sweep()), "demo")
    by_n = figure.axes[0]
    dashed = [line for line in by_n.get_lines() if "extrapolated" in str(line.get_label())]
    drawn = {str(line.get_label()): line for line in dashed}
    assert {"full (extrapolated)", "g (extrapolated)"} <= set(drawn)
    for label in ("full (extrapolated)", "g (extrapolated)"):
        assert drawn[label].get_linestyle() == "--"
        assert max(drawn[label].get_xdata()) == pytest.approx(6.74e9)
    solid = [line for line in by_n.get_lines() if str(line.get_label()) == "g (fit)"]
    assert solid[0].get_linestyle() == "-" and max(solid[0].get_xdata()) == pytest.approx(1e8)
    assert "extrapolated" in caption


def test_one_model_size_gets_no_scaling_fit() -> None:
    result = scaling(_sweep())
    assert result.fits == {}
    assert result.missing[0] == "full: no fit: 1 model size (tiny); a power law in N needs 2."


def test_one_model_size_is_one_line_in_the_report(tmp_path: Path) -> None:
    blocks, texts = protocol_sections(_sweep(), "demo", tmp_path)
    assert texts[-1] == (
        "Scaling across model sizes: not fitted. A power law in parameters needs at least 2 "
        "model sizes with a finished trial of one method; this sweep has 1 (tiny).")
    assert blocks[-1] == Paragraph(texts[-1])  # the page says it too, with no table
    assert (tmp_path / "speedup.csv").exists() and not (tmp_path / "scaling.csv").exists()


def test_the_best_set_is_one_tuned_configuration_not_every_one_at_its_lr() -> None:
    # AdamW tuned over betas: at lr 1e-3, betas (0.9, 0.95) mean 3.1 and (0.9, 0.999) mean 3.3
    # (pooled at that LR: 3.2 over 4 trials); (0.9, 0.999) at 2e-3: 3.2. Best: the first, n=2.
    def tuned(loss: float, lr: float, betas: list[float], seed: int) -> dict:
        return {**_trial("full", 1e6, loss, lr=lr, seed=seed), "method.betas": betas}
    sweep = pd.DataFrame([tuned(3.0, 1e-3, [0.9, 0.95], 0), tuned(3.2, 1e-3, [0.9, 0.95], 1),
                          tuned(3.25, 1e-3, [0.9, 0.999], 0), tuned(3.35, 1e-3, [0.9, 0.999], 1),
                          tuned(3.15, 2e-3, [0.9, 0.999], 0), tuned(3.25, 2e-3, [0.9, 0.999], 1)])
    (best,) = best_sets(sweep).to_dict("records")
    assert (best["lr"], best["tuned"], best["n"]) == (1e-3, "betas=(0.9, 0.95)", 2)
    assert best["mean"] == pytest.approx(3.1) and best["losses"] == (3.0, 3.2)


def test_adamws_rows_come_first_budgets_rising_and_carry_no_extrapolation_note() -> None:
    # the trials given in falling budgets and `fast` first; AdamW's 8M point put 0.001 below
    # its law, so D_AdamW there lies past its largest budget (a method's point would say so)
    rows = [_trial(m, D, _adamw(D) - (0.001 if (m, D) == ("full", 8e6) else 0))
            for m in ("fast", "full") for D in reversed(BUDGETS)]
    points = speedups(pd.DataFrame(rows)).points
    assert list(zip(points["variant"], points["tokens"], strict=True)) == [
        ("full", D) for D in BUDGETS] + [("fast", D) for D in BUDGETS]
    full = points[points["variant"] == "full"]
    assert full["tokens_adamw"].iloc[-1] > 8e6 and set(full["note"]) == {""}
