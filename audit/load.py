"""Reading a bundle's raw arm records, frozen references and tables, each checked against the document
and table definitions of the format contract as it is read; what cannot be read is a discrepancy."""
from __future__ import annotations

from typing import Any

import pandas as pd
import pyarrow.parquet as pq

from . import contract
from .context import Audit

RECORD = contract.DOCS["record"]
REFERENCES = contract.DOCS["references"]
ENVIRONMENT = contract.DOCS["environment"]


def _phase_problem(data: Any, phase: str, closed: bool) -> str | None:
    if not isinstance(data, dict):
        return f"{phase} is {data!r}"
    problem = contract.fields_problem(data, RECORD["phase_fields"], f"{phase}.", RECORD["phase_optional"], closed)
    if problem is not None:
        return problem
    if not data["elapsed_s"] > 0:
        return f"{phase}.elapsed_s is {data['elapsed_s']!r}"
    for rid, out in data["outputs"].items():
        if not isinstance(out, dict):
            return f"{phase}.outputs.{rid} is {out!r}"
        problem = contract.fields_problem(out, RECORD["output_fields"], f"{phase}.outputs.{rid}.", closed=closed)
        if problem is not None:
            return problem
    return None


def _coverage_problem(rec: dict, closed: bool) -> str | None:
    """Records of schema 2 and later carry ``coverage``; schema 1 (bundles before it) has none."""
    schema = rec.get("schema", 1)
    if not contract.is_kind(schema, "int"):
        return f"schema is {schema!r}"
    if schema > RECORD["latest_schema"]:
        return f"schema is {schema}, later than the contract's latest record schema {RECORD['latest_schema']}"
    if schema < RECORD["coverage_since_schema"]:
        return "coverage is in a schema-1 record" if "coverage" in rec else None
    cov = rec.get("coverage")
    if not isinstance(cov, dict):
        return f"coverage is {cov!r}"
    return contract.fields_problem(cov, RECORD["coverage_fields"], "coverage.", closed=closed)


def record_problem(rec: Any, closed: bool = False) -> str | None:
    """Why ``rec`` is not a raw arm record (a field missing or of the wrong JSON type; ``closed``, format
    version 2: or a field the contract does not define), or None."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an object"
    problem = contract.fields_problem(rec, RECORD["fields"], "", RECORD["optional"], closed)
    if problem is not None:
        return problem
    if rec["position"] not in RECORD["positions"]:
        return f"position is {rec['position']!r}"
    problem = contract.fields_problem(rec["device"], RECORD["device_fields"], "device.", RECORD["device_optional"],
                                      closed)
    if isinstance(rec.get("wall_clock"), dict):
        problem = problem or contract.fields_problem(rec["wall_clock"], RECORD["wall_clock_fields"], "wall_clock.",
                                                     closed=closed)
    if problem is not None:
        return problem
    for phase in RECORD["phases"]:
        if phase == "warmup" and rec.get(phase) is None:  # a run without warmup
            continue
        problem = _phase_problem(rec.get(phase), phase, closed)
        if problem is not None:
            return problem
    return _coverage_problem(rec, closed)


def record_file_name(rec: dict) -> str:
    return RECORD["file_name"].format(**rec)


def load_records(ctx: Audit) -> list[dict]:
    """Every file under raw/ must be one arm record at raw/<job>/<record file name> (dotfiles included)."""
    raw = ctx.bundle / "raw"
    records, seen = [], {}
    for path in sorted(raw.rglob("*")) if raw.is_dir() else []:
        if not path.is_file():
            continue
        rel, parts = path.relative_to(ctx.bundle).as_posix(), path.relative_to(raw).parts
        if len(parts) != 2 or path.suffix != ".json":
            ctx.fail("raw", f"{rel} is not a raw/<job>/<arm>.json record file")
            continue
        rec = ctx.read_json(rel, "raw")
        if rec is None:
            continue
        problem = record_problem(rec, ctx.version >= contract.CLOSED_SINCE)
        if problem is not None:
            ctx.fail("raw", f"{rel} is not an arm record: {problem}")
            continue
        if parts != (rec["job"], record_file_name(rec)):
            ctx.fail("raw", f"{rel} holds {rec['job']} seq {rec['seq']}, whose file is "
                            f"raw/{rec['job']}/{record_file_name(rec)}")
        key = (rec["job"], rec["seq"])
        if key in seen:
            ctx.fail("raw", f"{rel} repeats {rec['job']} seq {rec['seq']} of {seen[key]}")
            continue
        seen[key] = rel
        records.append(rec)
    return sorted(records, key=lambda r: (r["job"], r["seq"]))


def load_references(ctx: Audit, plan: dict) -> dict[str, dict]:
    """Per point with a frozen reference: its schedule and the reference's work counters."""
    refs = {}
    for pt in plan["points"]:
        ref = pt.get("reference")
        if not ref:
            continue
        schedule, meta = ctx.read_json(ref["file"], "reference"), ctx.read_json(ref["meta_file"], "reference")
        if not (isinstance(schedule, dict) and isinstance(meta, dict)):
            continue
        problem = _reference_problem(schedule, meta, ctx.version >= contract.CLOSED_SINCE)
        if problem is not None:
            ctx.fail("reference", f"{pt['key']}: {problem}")
            continue
        refs[pt["key"]] = {"schedule": schedule, "work": meta["work"]}
    return refs


def _reference_problem(schedule: dict, meta: dict, closed: bool) -> str | None:
    """Why a frozen reference's schedule or meta lacks a field of the contract (or has one of another type;
    ``closed``: or one the contract does not define)."""
    problem = contract.fields_problem(schedule, REFERENCES["schedule_fields"], "schedule ", closed=closed) \
        or contract.fields_problem(meta, REFERENCES["meta_fields"], "meta ", REFERENCES["meta_optional"], closed)
    for r in schedule["requests"] if problem is None else []:
        problem = problem or (contract.fields_problem(r, REFERENCES["schedule_request_fields"], "schedule request ",
                                                      closed=closed)
                              if isinstance(r, dict) else f"schedule request {r!r}")
    return problem


def environment_problem(env: Any, closed: bool = False, version: int = contract.VERSION) -> str | None:
    """Why ``environment.json`` of format ``version`` is not the contract's document (a field missing or of another
    JSON type; from format 15 its ``cpu_load`` record, when not null, with the record's fields)."""
    if not isinstance(env, dict):
        return f"a JSON {type(env).__name__}, not an object"
    problem = contract.fields_problem(env, contract.fields_at(ENVIRONMENT["fields"], ENVIRONMENT["fields_since"], version),
                                      "", closed=closed)
    if problem is None and isinstance(env.get("cpu_load"), dict) and "cpu_load" in contract.fields_at(
            ENVIRONMENT["fields"], ENVIRONMENT["fields_since"], version):
        problem = contract.fields_problem(env["cpu_load"], ENVIRONMENT["cpu_load_fields"], "cpu_load.", closed=closed)
    for part in ("python", "cpu", "torch"):
        problem = problem or contract.fields_problem(env[part], ENVIRONMENT[f"{part}_fields"], f"{part}.",
                                                     closed=closed)
    for part, kind in (("packages", "package_version"), ("env", "env_value")):
        values = env[part].items() if problem is None else []
        bad = [k for k, v in values if not contract.is_kind(v, ENVIRONMENT[kind])]
        problem = problem or (f"{part}.{bad[0]} is {env[part][bad[0]]!r}" if bad else None)
    return problem


def check_environment(ctx: Audit, env: Any) -> None:
    problem = environment_problem(env, ctx.version >= contract.CLOSED_SINCE, ctx.version)
    if problem is not None:
        ctx.fail("environment.json", f"is not the environment document of {contract.WHERE}: {problem}")


def load_tables(ctx: Audit) -> dict[str, pd.DataFrame]:
    """Every table of the format that the bundle holds, with its schema version and declared column types."""
    tables = {}
    for name in contract.TABLES:
        rel = f"tables/{name}.parquet"
        if not (ctx.bundle / rel).is_file():
            continue
        try:
            schema = pq.read_schema(ctx.bundle / rel)
            tables[name] = pd.read_parquet(ctx.bundle / rel)
        except Exception as exc:
            ctx.fail("tables", f"{rel} could not be read: {type(exc).__name__}: {exc}")
            continue
        version = (schema.metadata or {}).get(b"loopbench_schema_version")
        if version != str(contract.FORMAT["tables"]["schema_version"]).encode():
            ctx.fail("tables", f"{rel} schema version {version!r}")
        # version 1 wrote a table without rows with some columns, untyped; version 2 writes them all, typed
        _check_columns(ctx, name, schema, typed=len(tables[name]) > 0 or ctx.version >= 2)
    return tables


def _check_columns(ctx: Audit, name: str, schema, typed: bool) -> None:
    """Every column is declared by the contract, of its declared type (a version-1 table without rows has
    no types)."""
    declared = contract.declared_columns(name)
    for field in schema:
        if field.name not in declared:
            ctx.fail(f"{name}.parquet", f"has column {field.name!r}, which {contract.WHERE} does not declare")
            continue
        problem = contract.column_type_problem(name, field.name, str(field.type), ctx.version >= 2) \
            if typed else None
        if problem is not None:
            ctx.fail(f"{name}.parquet", problem)
