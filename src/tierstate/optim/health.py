"""Telemetry's health checks set up from this machine: the probed peaks and its RAM."""
from __future__ import annotations

import logging

_log = logging.getLogger("tierstate")


def configure_health(telemetry) -> None:
    """Peaks from a saved `tierstate probe` profile (for achieved-vs-peak and the slow-tier
    warning) and the host-RAM warning at 90 % of this machine's RAM."""
    import psutil

    from ..placement.probe import load_profile, peaks_from_profile

    try:
        profile = load_profile()
    except (OSError, ValueError) as exc:  # a stale or broken profile must not stop training
        _log.warning("tierstate: hardware profile ignored (%s)", exc)
        profile = None
    if profile is not None:
        telemetry.set_peaks(peaks_from_profile(profile))
    telemetry.set_host_budget(psutil.virtual_memory().total)
