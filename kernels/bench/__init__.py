"""Kernel microbenchmarks (CUDA only), each writing a markdown table as it goes."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Callable, Sequence


def markdown_writer(path: Path) -> Callable[[str], None]:
    """``emit(line)``: print a report line and append it to ``path`` at once (flushed), so a benchmark
    that times out still leaves the rows measured so far. Creates the parent directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    md = path.open("w")

    def emit(line: str) -> None:
        print(line, flush=True)
        md.write(line + "\n")
        md.flush()

    return emit


def table_lines(columns: Sequence[str], rows: Sequence[dict]) -> list[str]:
    """A markdown table of ``rows`` (dicts keyed by ``columns``; floats with two decimals)."""
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)
    return (["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(fmt(r[c]) for c in columns) + " |" for r in rows])


def write_csv(path: Path, columns: Sequence[str], rows: Sequence[dict]) -> None:
    """``rows`` as a csv at ``path`` (floats rounded to 4 decimals)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns))
        w.writeheader()
        w.writerows({c: (round(r[c], 4) if isinstance(r[c], float) else r[c]) for c in columns} for r in rows)


def write_report(out: Path, lines: Sequence[str], columns: Sequence[str], rows: Sequence[dict]) -> None:
    """Print a report's markdown ``lines``, write them to ``out``, and ``rows`` as a csv beside it
    (:func:`write_csv`)."""
    text = "\n".join(lines) + "\n"
    print(text)
    out.write_text(text)
    write_csv(out.with_suffix(".csv"), columns, rows)
