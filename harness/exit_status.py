"""A child's exit status: the one form it is recorded in and the one way it is worded.

Recorded (``children.json`` ``exit_code``, the summary's ``children`` and ``child_failed`` codes, an online
record's ``server.exit_code``): an int or null, as Python's ``subprocess`` reports a process's end; the
contract's ``documents.children.exit_code`` (loopbench/bundle_format.json) defines it. Worded: by
:func:`exit_status_text` only, from the contract's ``documents.children.exit_status`` words, wherever an
exit status is shown (report.md's children table and ``child_failed`` text, the console). The auditor
re-derives the words with its own code from the same contract (audit/render.py ``exit_status``; it
imports nothing of the harness), and a test holds the two equal.

This module reads the contract through fileio.py, not evidence.py: the session child, whose online server
reports its exit through it, loads no dataframe library.
"""
from __future__ import annotations

from typing import Any, Mapping

from .fileio import bundle_format

WORDS: dict[str, Any] = bundle_format()["documents"]["children"]["exit_status"]


def exit_status_text(child: Mapping[str, Any]) -> str:
    """The words for the exit status of ``child``, a ``children.json`` entry (``exit_code``, and where it
    is null ``state``, ``interrupted_by`` and ``wall_s``); any mapping with an ``exit_code`` will do.

    The convention (the first rule that holds; ``documents.children.exit_status.rules``):

    - ``exit_code >= 0``: the process exited with that code -> ``"exit code 1"``;
    - ``exit_code < 0``: signal ``-exit_code`` ended it -> ``"killed by SIGTERM (15)"`` (Linux's signal
      names from the contract, never the host's; ``"killed by signal 77"`` for a number it does not name).
      A signal is never shown as the shell's 128 + N: a session child stopped by SIGTERM ends by the signal;
    - ``exit_code`` null: no exit status exists, and the words say why: ``"still running"`` (state
      ``running``: an unpublished bundle), ``"lost: no exit status recorded"`` (``interrupted_by`` lost:
      its controller died), ``"never started"`` (``wall_s`` null: the controller was stopped first), else
      ``"no exit status recorded"`` (a SLURM job scontrol no longer knew; a mapping without ``wall_s``).

    Never "None", never a bare negative number.
    """
    code = child["exit_code"]
    if code is not None and code >= 0:
        return WORDS["exited"].format(code=code)
    if code is not None:
        name = WORDS["signal_names"].get(str(-code))
        if name is None:
            return WORDS["signalled_unnamed"].format(number=-code)
        return WORDS["signalled"].format(signal=name, number=-code)
    if child.get("state") == "running":
        return WORDS["running"]
    if child.get("interrupted_by") == "lost":
        return WORDS["lost"]
    if "wall_s" in child and child["wall_s"] is None:
        return WORDS["not_started"]
    return WORDS["unknown"]
