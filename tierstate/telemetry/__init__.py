"""Where every byte and millisecond of an optimizer step went.

- :class:`Telemetry` — one per optimizer: phase timing on lanes, bytes per tier,
  counters, gauges, a :class:`StepStats` per step, health warnings, tracing.
- :data:`PHASES` — the phase names and what each covers.
- Traces: Chrome/Perfetto trace-event JSON, via ``Telemetry.start_trace(path)`` or the
  ``TIERSTATE_TRACE=path`` environment variable; :func:`validate_trace` checks one.
- ``tierstate report TRACE`` (``python -m tierstate.telemetry.report``) plots a trace.
- ``python -m tierstate.telemetry.overhead`` measures the per-phase cost.

Logging goes to ``logging.getLogger("tierstate")``, which gets a ``NullHandler`` here so
that an application that configures no logging sees nothing.
"""
import logging

logging.getLogger("tierstate").addHandler(logging.NullHandler())

from .health import HealthWarning  # noqa: E402
from .phases import CHANNELS, PHASES, register_phase  # noqa: E402
from .recorder import TRACE_ENV, Telemetry  # noqa: E402
from .stats import Bandwidth, StepStats  # noqa: E402
from .trace import TraceFormatError, load_trace, validate_trace  # noqa: E402

__all__ = [
    "Bandwidth", "CHANNELS", "HealthWarning", "PHASES", "StepStats", "TRACE_ENV",
    "Telemetry", "TraceFormatError", "load_trace", "register_phase", "validate_trace",
]
