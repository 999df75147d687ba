"""Progress lines for the phases of a run that take more than a few seconds, on stderr.

One line per event (``loopbench: <phase>: <what>``), never inside a measured run. ``loopbench --quiet``
(or ``LOOPBENCH_QUIET=1``, which the command sets so that every part of the run sees it) silences the
lines and the arms' progress bar; errors and the final table are printed regardless.
"""
from __future__ import annotations

import os
import sys

QUIET_ENV = "LOOPBENCH_QUIET"


def quiet() -> bool:
    """True when progress output is off (``LOOPBENCH_QUIET`` set to anything but "" or "0")."""
    return os.environ.get(QUIET_ENV, "") not in ("", "0")


def say(phase: str, what: str) -> None:
    """Print ``loopbench: <phase>: <what>`` on stderr unless quiet."""
    if not quiet():
        print(f"loopbench: {phase}: {what}", file=sys.stderr, flush=True)


def counted(count: int, noun: str) -> str:
    """"1 point", "2 points": a count with its noun in its number (a noun whose plural is not noun + s: write both)."""
    return f"{count} {noun}{'s' * (count != 1)}"


def mib(n_bytes: int) -> str:
    """``n_bytes`` as MiB with one decimal ("12.3 MiB")."""
    return f"{n_bytes / 2**20:,.1f} MiB"


def duration(seconds: float) -> str:
    """A duration for people: "42 s", "3.5 min", "1.2 h"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
