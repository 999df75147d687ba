"""The shared state of one audit: the bundle, the format version it follows, the discrepancies found and
the counts of what was checked. Every check is a function taking this context first."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import contract

MAX_PER_KIND = 20


class Audit:
    """Collects discrepancies; each check runs even when an earlier one failed."""

    def __init__(self, bundle: Path):
        self.bundle = Path(bundle)
        self.version = contract.VERSION   # the manifest's, once read (check_files.check_manifest)
        self.discrepancies: list[str] = []
        self._counts: dict[str, int] = {}
        self.checked: dict[str, int] = {}
        self.online_summary: dict | None = None   # the re-derived online/summary.json (check_online), format 5
        self.online_records: list[dict] = []   # the online records that load (check_online), format 5
        self.roofline: tuple[list[dict], dict] | None = None   # derived rows and ceilings (check_roofline), format 7
        self.superseded: list[tuple[str, dict]] = []   # (path, record) a resume superseded (check_superseded), format 15

    def fail(self, kind: str, message: str) -> None:
        n = self._counts.get(kind, 0) + 1
        self._counts[kind] = n
        if n <= MAX_PER_KIND:
            self.discrepancies.append(f"{kind}: {message}")
        elif n == MAX_PER_KIND + 1:
            self.discrepancies.append(f"{kind}: further discrepancies of this kind not listed")

    def count(self, what: str, n: int = 1) -> None:
        self.checked[what] = self.checked.get(what, 0) + n

    def section(self, name: str, fn, *args) -> Any:
        """``fn(self, *args)``; an exception is a discrepancy of kind ``name`` (the bundle was too broken to
        check), never a crash."""
        try:
            return fn(self, *args)
        except Exception as exc:
            self.fail(name, f"could not be checked: {type(exc).__name__}: {exc}")
            return None

    def read_json(self, rel: str, kind: str = "files") -> Any:
        """The parsed file, or None: a missing file is named by the required-files check, an unreadable one here."""
        path = self.bundle / rel
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except Exception as exc:
            self.fail(kind, f"{rel} could not be read: {type(exc).__name__}: {exc}")
            return None
