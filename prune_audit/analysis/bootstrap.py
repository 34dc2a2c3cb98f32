"""Image-clustered bootstrap: resample images with replacement, keep all their questions.

Questions of one image are correlated (same picture; POPE repeats its "yes" questions in
every split), so the resampling unit is the image (Field & Welsh 2007, "Bootstrapping
clustered data"). A resample is represented by how many times each image was drawn; a
question's weight is its image's count, and the metrics of
``prune_audit.analysis.metrics`` evaluate all resamples from those weights at once.
Runs analysed with the same seed over the same images get the same resamples, so their
replicate-wise differences give paired intervals.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

Statistic = Callable[[np.ndarray | None], Mapping[str, float | np.ndarray]]
"""Maps weights (B, n) or None to metric values: (B,) arrays or, for None, floats."""

CHUNK_REPLICATES = 256
"""Resamples evaluated together: bounds the (chunk, n) weight matrix to a few tens of MB."""


def image_counts(n_images: int, replicates: int, seed: int) -> np.ndarray:
    """(replicates, n_images) int64: times each image is drawn in each resample of n_images draws."""
    if n_images < 1 or replicates < 1:
        raise ValueError(f"need at least one image and one replicate, got {n_images} and {replicates}")
    draws = np.random.default_rng(seed).integers(0, n_images, size=(replicates, n_images))
    offsets = np.arange(replicates)[:, None] * n_images
    return np.bincount((draws + offsets).ravel(), minlength=replicates * n_images).reshape(replicates, n_images)


def bootstrap_replicates(statistic: Statistic, image_index: np.ndarray, counts: np.ndarray) -> dict[str, np.ndarray]:
    """Evaluate ``statistic`` on every resample; returns name -> (B,) values.

    Args:
        statistic: metric function of question weights.
        image_index: (n,) position of each question's image among the counts' columns.
        counts: (B, n_images) draws per image, from ``image_counts``.
    """
    parts: dict[str, list[np.ndarray]] = {}
    for start in range(0, len(counts), CHUNK_REPLICATES):
        weights = counts[start : start + CHUNK_REPLICATES].astype(np.float64)[:, image_index]
        for name, values in statistic(weights).items():
            parts.setdefault(name, []).append(np.asarray(values, dtype=np.float64))
    return {name: np.concatenate(chunks) for name, chunks in parts.items()}


def percentile_interval(replicates: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the finite replicates; (NaN, NaN) when none is finite."""
    finite = np.asarray(replicates, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    if finite.size == 0:
        return float("nan"), float("nan")
    tail = 100.0 * (1.0 - level) / 2.0
    low, high = np.percentile(finite, [tail, 100.0 - tail])
    return float(low), float(high)


def estimate(value: float, replicates: np.ndarray) -> dict[str, float | list[float]]:
    """A point estimate with its 95% percentile interval, as stored in the reports."""
    return {"value": float(value), "ci95": list(percentile_interval(replicates))}
