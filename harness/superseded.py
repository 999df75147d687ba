"""Records a resume supersedes (bundle format 15): where a lone arm's record goes, the move, and its report lines.

A pair's two arms run back to back in one session, so a resume measures again a pair whose other arm was not
recorded (a stop between the two; harness/resume.py). The arm already measured is a measurement all the same, and
nothing measured is lost (README, "Interrupted runs"): its raw record, or a lone online run's record with its
server log, moves from its path ``p`` in the bundle to ``superseded/<session>/p`` (the contract's
``superseded.path``), ``<session>`` being the session that measured it. That session measured the run once, so a
second interruption of the same pair, measured by another session, gets another path: nothing is overwritten.

The move is a rename in the bundle, so the bytes are the ones the session wrote; the files are hashed in
manifest.json like every other. Nothing that computes a figure reads them: the tables, summary, plot and checks
read ``raw/`` and ``online/`` only (evidence.load_records, online/evidence.py). The report lists them
(:func:`report_lines`); the auditor holds each to a planned run measured again by a later session
(audit/check_superseded.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .fileio import bundle_format

SPEC = bundle_format()["superseded"]


def moves(bundle: Path, record: Path, server_log: Path | None = None) -> list[tuple[Path, Path]]:
    """(from, to) for a lone run's ``record`` (and the ``server_log`` of an online run, where there is one) in
    ``bundle``; the log first, so that a resume killed between the two renames leaves the record in place, found
    lone again by the next resume, and the log already kept."""
    session = json.loads(record.read_text())["session"]
    files = ([server_log] if server_log is not None and server_log.is_file() else []) + [record]
    return [(f, bundle / place(session, f.relative_to(bundle).as_posix())) for f in files]


def place(session: str, rel: str) -> str:
    """The bundle path of the file at bundle path ``rel`` that session ``session`` wrote, once superseded."""
    return SPEC["path"].format(folder=SPEC["folder"], session=session, path=rel)


def taken(planned: list[tuple[Path, Path]]) -> list[Path]:
    """The destinations of ``planned`` moves that a file holds already (none in a bundle a resume wrote)."""
    return [to for _, to in planned if to.exists()]


def set_aside(planned: list[tuple[Path, Path]]) -> None:
    """Rename each file of ``planned`` (:func:`moves`) to its place under superseded/; FileExistsError, before
    anything moves, where a place is taken (a superseded record is never overwritten)."""
    clash = taken(planned)
    if clash:
        raise FileExistsError(f"{clash[0]} exists already; a superseded record is never overwritten")
    for src, dst in planned:
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)


def report_lines(bundle: Path, children: list[dict]) -> list[str]:
    """The report's section of the superseded records (``superseded.report``): none without any; else its heading,
    how many there are and a row per record (not their server logs), by the session that measured it in the order of
    ``children`` (children.json's entries), then by path."""
    from .report import fill, table_lines

    spec, folder = SPEC["report"], Path(bundle) / SPEC["folder"]
    records = sorted(p for p in folder.rglob("*.json") if p.is_file()) if folder.is_dir() else []
    if not records:
        return []
    runs = [(path.relative_to(bundle).as_posix(), json.loads(path.read_text())) for path in records]
    rank = {c.get("session", c["name"]): i for i, c in enumerate(children)}
    rows = [spec["row"].format(file=rel, session=rec["session"], seq=rec["seq"], arm=rec["arm"])
            for rel, rec in sorted(runs, key=lambda run: (rank.get(run[1]["session"], len(rank)), run[0]))]
    return ["", spec["heading"], "", fill(spec["text"], runs=len(rows)), ""] + table_lines(spec["columns"], rows)
