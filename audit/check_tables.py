"""Checks of the timings and the tables: tokens/s = C * D / elapsed_s; each measured elapsed_s lies
within its record's wall-clock span; every row and column of every table equals what the raw records
give (no row missing, extra or repeated; no column the records do not give)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from . import contract, derive
from .context import Audit
from .values import REL_TOL, plain, same, where

# A measured run is timed by time.perf_counter inside the record's wall-clock span (time.time, read just
# outside it), so an honest span exceeds elapsed_s by the set-up between the reads. On Linux both clocks
# (CLOCK_MONOTONIC, CLOCK_REALTIME) run at the same NTP-slewed rate; the tolerance covers the rounding of
# unix-second floats (~2e-7 s) and clock resolution with a wide margin. Only a step of the system clock
# during a run could trip it honestly, and such a span could not vouch for the timing anyway.
WALL_CLOCK_ABS_TOL_S = 1e-3
WALL_CLOCK_REL_TOL = 1e-3


def check_timing(ctx: Audit, records: list[dict]) -> None:
    for r in records:
        tps = derive.tokens_per_s(r)
        if not math.isclose(tps, r["tokens_per_s"], rel_tol=REL_TOL):
            ctx.fail("timing", f"record {r['job']} seq {r['seq']} ({r['arm']}): tokens_per_s {r['tokens_per_s']} "
                               f"!= C*D/elapsed_s = {tps}")


def _span(wall) -> tuple[float, float] | None:
    start, end = (wall.get("measured_start_unix_s"), wall.get("measured_end_unix_s")) \
        if isinstance(wall, dict) else (None, None)
    if not all(contract.is_kind(t, "number") and math.isfinite(t) for t in (start, end)) or end < start:
        return None
    return start, end


def check_wall_clock(ctx: Audit, records: list[dict]) -> None:
    """Each measured elapsed_s (> 0, see the record rules) lies within its record's wall-clock span."""
    for r in records:
        where_ = f"record {r['job']} seq {r['seq']} ({r['arm']})"
        wall, elapsed = r.get("wall_clock"), r["measured"]["elapsed_s"]
        span = _span(wall)
        if span is None:
            ctx.fail("timing", f"{where_}: no wall-clock span to bound its measured elapsed_s: wall_clock is {wall!r}")
            continue
        length = span[1] - span[0]
        if elapsed > length * (1 + WALL_CLOCK_REL_TOL) + WALL_CLOCK_ABS_TOL_S:
            ctx.fail("timing", f"{where_}: measured elapsed_s {elapsed!r} is longer than its wall-clock span "
                               f"{length!r} s (wall_clock.measured_start_unix_s .. measured_end_unix_s)")
        ctx.count("wall_clock_spans")


def mismatches(table: pd.Series, raw: pd.Series) -> np.ndarray:
    """Boolean mask of differing cells: vectorised for plain number columns, item by item otherwise."""
    types = pd.api.types
    if types.is_integer_dtype(table) and types.is_integer_dtype(raw):
        return table.to_numpy() != raw.to_numpy()
    if all(types.is_numeric_dtype(s) and not types.is_bool_dtype(s) for s in (table, raw)):
        a, b = table.to_numpy(dtype=float), raw.to_numpy(dtype=float)
        return ~(np.isclose(a, b, rtol=REL_TOL, atol=0.0) | (np.isnan(a) & np.isnan(b)))
    return np.array([not same(a, b) for a, b in zip(table, raw)], dtype=bool)


def _check_rows(ctx: Audit, kind: str, keys: list[str], got: pd.DataFrame, want: pd.DataFrame) -> pd.DataFrame:
    """Names repeated, missing and extra rows; returns the rows both sides have, merged."""
    dup = got[got.duplicated(keys, keep="first")]
    for values in dup[keys].itertuples(index=False):
        ctx.fail(kind, f"repeats the row of {where(tuple(keys), tuple(values))}")
    m = want.merge(got.drop_duplicates(keys), on=keys, how="outer", suffixes=("_raw", "_table"), indicator=True)
    for values, side in zip(m[keys].itertuples(index=False), m["_merge"]):
        if side == "left_only":
            ctx.fail(kind, f"lacks the row of {where(tuple(keys), tuple(values))}")
        elif side == "right_only":
            ctx.fail(kind, f"has a row for {where(tuple(keys), tuple(values))} that the raw records do not give")
    return m[m["_merge"] == "both"]


def check_table(ctx: Audit, name: str, got: pd.DataFrame, want: pd.DataFrame) -> None:
    """Every row and column of ``tables/<name>.parquet`` against the rows the raw records give."""
    later = contract.columns_since(name, ctx.version)   # a key column added later (telemetry sample, format 5)
    kind, keys = f"{name}.parquet", [k for k in contract.TABLE_KEYS[name] if k not in later]
    if len(want) == 0 or len(got) == 0:
        if len(want) != len(got):
            ctx.fail(kind, f"has {len(got)} rows, the raw records give {len(want)}")
        if len(got) == 0 and ctx.version >= 2:   # version 1 wrote tables without rows with some columns
            for col in [c for c, spec in contract.declared_columns(name).items() if c not in got.columns
                        and not spec.get("optional") and c not in contract.columns_since(name, ctx.version)]:
                ctx.fail(kind, f"has no rows and lacks the declared column {col!r}")
        return
    for col in [c for c in want.columns if c not in got.columns]:
        ctx.fail(kind, f"lacks column {col!r}")
    for col in [c for c in got.columns if c not in want.columns]:
        ctx.fail(kind, f"has column {col!r}, which the raw records do not give")
    if any(k not in got.columns for k in keys):
        return
    both = _check_rows(ctx, kind, keys, got, want)
    for col in [c for c in want.columns if c in got.columns and c not in keys]:
        table, raw = both[f"{col}_table"], both[f"{col}_raw"]
        for i in np.flatnonzero(mismatches(table, raw)):
            at = where(tuple(keys), tuple(both[keys].iloc[i]))
            ctx.fail(kind, f"{col} of {at} is {plain(table.iloc[i])!r}, the raw records give {plain(raw.iloc[i])!r}")
    ctx.count(f"{name}_cells", len(both) * len(want.columns))


def check_tables(ctx: Audit, records: list[dict], tables: dict[str, pd.DataFrame]) -> None:
    expected = derive.expected_tables(records)
    for name, got in tables.items():
        later = contract.columns_since(name, ctx.version)   # not in a bundle of this (earlier) version
        ctx.section(f"{name}.parquet", check_table, name, got, expected[name].drop(columns=later, errors="ignore"))
