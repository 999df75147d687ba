"""Kernel microbenchmarks (CUDA only), each writing a markdown table as it goes."""
from __future__ import annotations

from pathlib import Path
from typing import Callable


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
