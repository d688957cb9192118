"""Where every byte and millisecond of an optimizer step went.

- :class:`Telemetry` — one per optimizer: phase timing on lanes, bytes per tier,
  counters, gauges, a :class:`StepStats` per step, health warnings, tracing.
- :data:`PHASES` — the phase names and what each covers.
- Traces: Chrome/Perfetto trace-event JSON, via ``Telemetry.start_trace(path)`` or the
  ``TIERSTATE_TRACE=path`` environment variable; :func:`validate_trace` checks one.
- ``tierstate report TRACE`` (``python -m tierstate.telemetry.report``) plots a trace.
- ``tierstate bench overhead --per-call`` measures the per-phase cost.

Logging goes to ``logging.getLogger("tierstate")``, which ``tierstate/__init__.py`` gives
a ``NullHandler`` so that an application that configures no logging sees nothing.
"""
from .health import HealthWarning
from .phases import CHANNELS, PHASES, register_phase
from .recorder import Telemetry
from .trace_env import TRACE_ENV
from .stats import Bandwidth, StepStats
from .trace import TraceFormatError, load_trace, validate_trace

__all__ = [
    "Bandwidth", "CHANNELS", "HealthWarning", "PHASES", "StepStats", "TRACE_ENV",
    "Telemetry", "TraceFormatError", "load_trace", "register_phase", "validate_trace",
]
