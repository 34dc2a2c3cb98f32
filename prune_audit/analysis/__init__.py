"""Metrics, calibration, temperature scaling, image bootstrap and the confidence cascade over run records.

>>> from prune_audit.analysis import load_run, expected_calibration_error, fit_temperature, calibration_audit

Names are imported on first use, so importing the package costs nothing.
"""

from prune_audit.lazy import lazy_exports

_EXPORTS = {
    # runs and their per-question arrays
    "load_run": "runs",
    "Run": "runs",
    "QuestionTable": "questions",
    # metrics of one set of questions
    "pope_scores": "metrics",
    "expected_calibration_error": "metrics",
    "maximum_calibration_error": "metrics",
    "debiased_calibration_error": "metrics",
    "brier": "metrics",
    "nll": "metrics",
    "auroc": "metrics",
    "aurc": "metrics",
    "reliability_curve": "metrics",
    # agreement of a pruned run's answers with the dense run's
    "loyalty": "metrics",
    "loyalty_overlap": "metrics",
    "token_f1": "metrics",
    # temperature scaling on held-out images
    "split_images": "temperature",
    "fit_temperature": "temperature",
    "scaled_probabilities": "temperature",
    "TemperatureFit": "temperature",
    # image-clustered bootstrap
    "image_counts": "bootstrap",
    "bootstrap_replicates": "bootstrap",
    "percentile_interval": "bootstrap",
    "estimate": "bootstrap",
    # the audits behind `prune-audit calibrate` and `prune-audit cascade`
    "CalibrationSettings": "calibration",
    "calibration_audit": "calibration",
    "cascade_audit": "cascade",
    # lost objects of a pruned run vs the unpruned model (the demo model card's table)
    "lost_object_summary": "lost_objects",
    "LostObjectSummary": "lost_objects",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
