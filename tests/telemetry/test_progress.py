"""Progress bars of long commands: drawn on a terminal on local rank 0 only."""
from __future__ import annotations

import io
import sys

from tierstate.telemetry.progress import progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_drawn_on_rank_zero_terminal(monkeypatch) -> None:
    out = _Tty()
    monkeypatch.setattr(sys, "stderr", out)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with progress(3, "rounds") as advance:
        for _ in range(3):
            advance()
    assert "rounds" in out.getvalue()


def test_silent_on_other_ranks_and_without_a_terminal(monkeypatch) -> None:
    out = _Tty()
    monkeypatch.setattr(sys, "stderr", out)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with progress(3, "rounds") as advance:
        advance()
    assert out.getvalue() == ""
    plain = io.StringIO()
    monkeypatch.setattr(sys, "stderr", plain)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with progress(3, "rounds") as advance:
        advance()
    assert plain.getvalue() == ""
