"""Telemetry tests start their own traces: a TIERSTATE_TRACE set in the developer's
shell would make every Telemetry trace already and turn start_trace into an error."""
import pytest


@pytest.fixture(autouse=True)
def _no_env_trace(monkeypatch):
    monkeypatch.delenv("TIERSTATE_TRACE", raising=False)
