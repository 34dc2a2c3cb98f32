"""Image-disjoint calibration/test splits and temperature scaling of the two-way logit."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prune_audit.analysis.metrics import nll
from prune_audit.errors import PruneAuditError

TEMPERATURE_BOUNDS = (1e-2, 1e2)
"""Search range of T; a fit within 0.1% (in log T) of either end is flagged ``at_bound``."""


def split_images(image_ids: np.ndarray, calibration_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of the distinct image ids into (calibration, test), both sorted.

    POPE's three splits share their images and their "yes" questions, so every split of
    questions is made by image: all questions of an image land on the same side. The
    calibration side holds round(fraction * images) images; the split depends only on the
    set of ids and the seed, so runs over the same questions get the same split.
    """
    unique = np.unique(np.asarray(image_ids))
    if not 0.0 < calibration_fraction < 1.0:
        raise PruneAuditError(f"--calibration-fraction must lie strictly between 0 and 1, got {calibration_fraction}")
    size = int(round(calibration_fraction * len(unique)))
    if size == 0 or size == len(unique):
        raise PruneAuditError(
            f"a calibration fraction of {calibration_fraction} of {len(unique)} images leaves one side empty; "
            "use more images or a fraction nearer 0.5"
        )
    order = np.random.default_rng(seed).permutation(len(unique))
    return np.sort(unique[order[:size]]), np.sort(unique[order[size:]])


def scaled_probabilities(logit_diff: np.ndarray, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """(p_yes, confidence), each (n,), after temperature scaling: p_yes = sigmoid(d / T).

    The confidence is computed as sigmoid(|d| / T) rather than max(p, 1 - p) so that it keeps
    full precision near 1.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    scaled = np.asarray(logit_diff, dtype=np.float64) / temperature
    return _sigmoid(scaled), _sigmoid(np.abs(scaled))


def _sigmoid(values: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * values))


@dataclass(frozen=True)
class TemperatureFit:
    """A fitted temperature and the calibration-set NLL (nats) before (T = 1) and after."""

    temperature: float
    at_bound: bool
    nll_before: float
    nll_after: float


def fit_temperature(logit_diff: np.ndarray, label_yes: np.ndarray) -> TemperatureFit:
    """Fit T minimising the NLL of the labels under p_yes = sigmoid(d / T).

    Follows the temperature scaling of Guo et al. 2017 (reference code
    gpleiss/temperature_scaling, which runs LBFGS on T from 1.5 and can leave T <= 0); here a
    bounded 1-D Brent search over log T in ``TEMPERATURE_BOUNDS`` keeps T > 0 and converges
    reliably: the NLL is convex in 1/T (a one-feature logistic regression without intercept),
    hence unimodal in log T.
    """
    from scipy.optimize import minimize_scalar

    logit_diff = np.asarray(logit_diff, dtype=np.float64)
    if len(logit_diff) == 0:
        raise PruneAuditError("no calibration questions to fit a temperature on")
    low, high = np.log(TEMPERATURE_BOUNDS)
    result = minimize_scalar(
        lambda log_t: nll(logit_diff / np.exp(log_t), label_yes),
        bounds=(low, high),
        method="bounded",
        options={"xatol": 1e-7},
    )
    log_t = float(result.x)
    return TemperatureFit(
        temperature=float(np.exp(log_t)),
        at_bound=bool(min(log_t - low, high - log_t) < 1e-3 * (high - low)),
        nll_before=float(nll(logit_diff, label_yes)),
        nll_after=float(nll(logit_diff / np.exp(log_t), label_yes)),
    )
