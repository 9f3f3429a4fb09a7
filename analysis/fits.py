"""Power laws fitted to final losses: L(x) = E + A·x^−α, x tokens (budgets) or parameters.

The fit runs on x scaled by a reference x0 (the geometric mean of the points), as
L = E + B·(x/x0)^−α with B = A·x0^−α: B is then the loss above the floor at x0, of the size of
the losses, so the least-squares problem is well scaled and B's error means something (A's
error in raw units is mostly its correlation with α). Bounds: E ≥ 0, B ≥ 0, 0 < α ≤ ALPHA_MAX.
Without a floor (few points), E is held at 0: L = A·x^−α, a straight line in log-log.

Errors are one standard deviation from the fit's covariance: from the seeds' spread when each
point carries one (`sigma`, absolute), else from the residuals, which needs more points than
parameters; where neither is there they are NaN, never guessed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import OptimizeWarning, curve_fit

from harness.errors import UserError

ALPHA_MAX = 5.0  # an exponent past this is no power law a loss curve follows
ALPHA_BOUNDS = (1e-4, 0.999 * ALPHA_MAX)  # a fitted α outside: the law sits on a bound
ALPHA_GRID = np.geomspace(1e-3, ALPHA_MAX, 100)  # starting points for the refinement


@dataclass(frozen=True)
class PowerLaw:
    """L(x) = E + A·x^−α, stored as E + B·(x/x0)^−α; `errors` are 1σ of (E, B, α)."""

    E: float
    B: float
    alpha: float
    x0: float
    errors: tuple[float, float, float]
    n: int  # points fitted
    floor: bool  # False: E held at 0
    chi2_dof: float = math.nan  # reduced χ² against the seeds' spread, where known and dof > 0

    @property
    def A(self) -> float:
        return self.B * self.x0**self.alpha

    def loss(self, x: np.ndarray | float) -> np.ndarray:
        return self.E + self.B * (np.asarray(x, dtype=float) / self.x0) ** -self.alpha

    def inverse(self, loss: float) -> float:
        """The x at which the law reaches `loss`: x0·(B/(L−E))^(1/α); inf at or below the
        floor E, which the law never reaches."""
        if loss <= self.E:
            return math.inf
        return self.x0 * (self.B / (loss - self.E)) ** (1 / self.alpha)

    def describe(self, x: str = "D") -> str:
        """E.g. "L(D) = 2.31 ± 0.05 + 1.2 ± 0.1·(D/1e+08)^−(0.29 ± 0.02), 5 points"."""
        e, b, a = (_pm(v, s) for v, s in zip((self.E, self.B, self.alpha), self.errors,
                                              strict=True))
        head = f"L({x}) = {e} + {b}" if self.floor else f"L({x}) = {b}"
        text = f"{head}·({x}/{self.x0:.3g})^−({a}), {self.n} points"
        return text if math.isnan(self.chi2_dof) else f"{text}, χ²/dof {self.chi2_dof:.2g}"


def min_points(floor: bool) -> int:
    """A law with a floor has three parameters, one without it two: each needs that many."""
    return 3 if floor else 2


def fit_power_law(x: Sequence[float], y: Sequence[float], sigma: Sequence[float] | None = None,
                  floor: bool = True) -> PowerLaw:
    """Least squares of L = E + B·(x/x0)^−α (E = 0 without `floor`), weighted by `sigma` (the
    standard error of each point) when every one is finite and positive."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    need = min_points(floor)
    if len(xs) < need or len(np.unique(xs)) < need:
        form = "E + A·x^−α" if floor else "A·x^−α"
        raise UserError(f"a fit of L = {form} needs at least {need} distinct points; got "
                        f"{len(np.unique(xs))}")
    if (xs <= 0).any() or not np.isfinite(ys).all():
        raise UserError("a power-law fit needs positive x and finite losses")
    weights = None if sigma is None else np.asarray(sigma, dtype=float)
    if weights is not None and not (np.isfinite(weights).all() and (weights > 0).all()):
        weights = None
    x0 = float(np.exp(np.log(xs).mean()))
    z = xs / x0
    start = _start(z, ys, weights, floor)
    if floor:
        model = _with_floor
        bounds = ([0.0, 0.0, 1e-6], [np.inf, np.inf, ALPHA_MAX])
    else:
        model = _without_floor
        bounds = ([0.0, 1e-6], [np.inf, ALPHA_MAX])
        start = start[1:]
    dof = len(xs) - len(start)
    absolute = weights is not None
    with warnings.catch_warnings():  # an exact fit (dof 0) has no covariance: NaN below
        warnings.simplefilter("ignore", OptimizeWarning)
        params, cov = curve_fit(model, z, ys, p0=start, sigma=weights, absolute_sigma=absolute,
                                bounds=bounds, max_nfev=10_000)
    errors = np.sqrt(np.diag(cov)) if absolute or dof > 0 else np.full(len(params), np.nan)
    chi2 = math.nan
    if absolute and dof > 0:
        chi2 = float((((ys - model(z, *params)) / weights) ** 2).sum() / dof)
    if not floor:
        params, errors = np.r_[0.0, params], np.r_[0.0, errors]
    return PowerLaw(E=float(params[0]), B=float(params[1]), alpha=float(params[2]), x0=x0,
                    errors=(float(errors[0]), float(errors[1]), float(errors[2])),
                    n=len(xs), floor=floor, chi2_dof=chi2)


def try_fit(x: Sequence[float], y: Sequence[float], sigma: Sequence[float] | None = None,
            floor: bool = True) -> PowerLaw | str:
    """The law, or why there is none to read: the optimizer did not converge, or the losses
    do not fall as a power law (B at 0, or α at a bound: flat, rising or a step)."""
    try:
        law = fit_power_law(x, y, sigma, floor)
    except RuntimeError as error:  # curve_fit past max_nfev
        return f"the fit did not converge ({error})"
    low, high = ALPHA_BOUNDS
    scale = law.B  # the loss above the floor at x0
    if scale <= 1e-6 * max(abs(float(np.mean(y))), 1e-12) or not low < law.alpha < high:
        losses = ", ".join(f"{v:.4g}" for v in y)
        return (f"the losses ({losses}) do not fall as a power law (fitted α {law.alpha:.3g}, "
                f"B {law.B:.2g}; allowed: {low:g} < α < {high:g}, B > 0)")
    return law


def _with_floor(z: np.ndarray, e: float, b: float, alpha: float) -> np.ndarray:
    return e + b * z**-alpha


def _without_floor(z: np.ndarray, b: float, alpha: float) -> np.ndarray:
    return b * z**-alpha


def _start(z: np.ndarray, y: np.ndarray, sigma: np.ndarray | None, floor: bool) -> list[float]:
    """(E, B, α) to start from: for each α of a grid, E and B by linear least squares (the law
    is linear in them), keeping the best with E ≥ 0 and B ≥ 0; a local optimizer alone falls
    into the wrong basin when α is far from its guess."""
    w = np.ones_like(y) if sigma is None else 1 / sigma
    best: tuple[float, list[float]] = (math.inf, [0.0, float(y.mean()), 0.5])
    for alpha in ALPHA_GRID:
        u = z**-alpha
        columns = np.column_stack([np.ones_like(u), u]) if floor else u[:, None]
        coef = np.linalg.lstsq(columns * w[:, None], y * w, rcond=None)[0]
        e, b = (coef[0], coef[1]) if floor else (0.0, coef[0])
        if e < 0 or b < 0:
            continue
        cost = float((((e + b * u) - y) * w) @ (((e + b * u) - y) * w))
        if cost < best[0]:
            best = (cost, [float(e), float(b), float(alpha)])
    return best[1]


def _pm(value: float, error: float) -> str:
    """"2.31 ± 0.05", or "2.31" where the error cannot be estimated."""
    if math.isnan(error) or math.isinf(error):
        return f"{value:.3g}"
    return f"{value:.3g} ± {error:.2g}"
