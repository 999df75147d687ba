"""The bundle format contract as the auditor reads it: ``loopbench/bundle_format.json`` (audit/FORMAT.md).

The file is read as data (package data of ``loopbench``, never an import of the harness), and everything
the auditor knows about a bundle's shape comes from it: the files and where each may sit (the layout),
the tables and their declared columns, the JSON documents and their fields' types, the status codes and
their words, the report's sections. It also says which older versions this auditor still audits, and
by which rules (``versions``).
"""
from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any


def _read_format() -> dict:
    return json.loads(resources.files("loopbench").joinpath("bundle_format.json").read_text())


FORMAT = _read_format()
VERSION = FORMAT["version"]
SUPPORTED = tuple(FORMAT["supported_versions"])
WHERE = f"loopbench/bundle_format.json version {VERSION}"
TABLES = tuple(FORMAT["table_names"])
UNMANIFESTED = tuple(FORMAT["unmanifested"])
DOCS = FORMAT["documents"]
CODES = FORMAT["status_codes"]["codes"]
NATURAL_TABLES = tuple(FORMAT["natural_table_names"])   # format 5: checked by check_natural, not check_tables
ROOFLINE_TABLES = tuple(FORMAT.get("roofline_table_names", ()))   # format 7: checked by check_roofline
TABLE_KEYS = {name: tuple(FORMAT["tables"][name]["key"]) for name in TABLES + NATURAL_TABLES + ROOFLINE_TABLES}
ABSENT = object()

_JSON_TYPES = {"string": (str,), "int": (int,), "number": (int, float), "bool": (bool,), "object": (dict,),
               "list": (list,), "null": (type(None),)}


# ---------------------------------------------------------------------------------------- JSON fields

def is_kind(value: Any, kind: str) -> bool:
    """``value`` is of the contract's JSON type ``kind`` ("int", "number|null", ...); a bool is only a bool."""
    for k in kind.split("|"):
        if isinstance(value, bool):
            if k == "bool":
                return True
        elif isinstance(value, _JSON_TYPES[k]):
            return True
    return False


CLOSED_SINCE = DOCS["closed_since"]


def fields_problem(data: dict, fields: dict[str, str], where: str,
                   optional: dict[str, str] | None = None, closed: bool = False) -> str | None:
    """Why ``data`` lacks a required field of ``fields`` or holds one (or an optional one) of the wrong type;
    ``closed`` (format version 2): or holds a field neither lists."""
    extra = sorted(set(data) - set(fields) - set(optional or {})) if closed else []
    if extra:
        return f"{where}{extra[0]} is a field that {WHERE} does not define"
    for key, kind in fields.items():
        value = data.get(key, ABSENT)
        if value is ABSENT:
            return f"{where}{key} is missing"
        if not is_kind(value, kind):
            return f"{where}{key} is {value!r}"
    for key, kind in (optional or {}).items():
        if key in data and not is_kind(data[key], kind):
            return f"{where}{key} is {data[key]!r}"
    return None


def fields_at(fields: dict[str, str], since: dict[str, int] | None, version: int) -> dict[str, str]:
    """The ``fields`` a document of format ``version`` holds: those ``since`` (field -> first version) dates
    later are left out."""
    return {k: v for k, v in fields.items() if (since or {}).get(k, 1) <= version}


def reason_problem(reason: Any) -> str | None:
    """Why one ``incomplete_reasons`` entry is not a status code of the contract (with exactly its fields)."""
    if not isinstance(reason, dict) or not isinstance(reason.get("code"), str):
        return f"{reason!r} is not a status code object"
    spec = CODES.get(reason["code"])
    if spec is None:
        return f"code {reason['code']!r} is not a status code of {WHERE} ({sorted(CODES)})"
    extra = sorted(set(reason) - {"code"} - set(spec["fields"]))
    if extra:
        return f"code {reason['code']!r} has fields {extra} that {WHERE} does not define"
    problem = fields_problem(reason, spec["fields"], f"code {reason['code']!r}: ")
    stops = DOCS["children"]["interrupted_by_values"]
    if problem is None and reason["code"] == "stopped" and reason["by"] not in stops:
        return f"code 'stopped': by {reason['by']!r} is not one of {stops} ({WHERE})"
    return problem


def reason_text(reason: dict) -> str:
    """The contract's first words for a status code: a version-1 summary's sentence (report.md words a code
    in its bundle's version, audit/render.py)."""
    return CODES[reason["code"]]["text"].format(**{k: v for k, v in reason.items() if k != "code"})


def manifest_version(manifest: dict) -> Any:
    """The format version a manifest records: ``format_version``, or version 1's ``layout_version``, or
    (a manifest from before either field) 1."""
    return manifest.get("format_version", manifest.get("layout_version", 1))


# ------------------------------------------------------------------------------------------ columns

def declared_columns(table: str) -> dict[str, dict]:
    return {c["name"]: c for c in FORMAT["tables"][table]["columns"]}


def columns_since(table: str, version: int) -> list[str]:
    """The declared columns of ``table`` added after format ``version`` (their ``since`` is later), which a
    bundle of that version does not have."""
    return [c["name"] for c in FORMAT["tables"][table]["columns"] if c.get("since", 1) > version]


def _arrow_family(arrow_type: str) -> str:
    if "string" in arrow_type:
        return "string"
    if arrow_type.startswith("list"):
        return "list<int64>" if "int" in arrow_type else arrow_type
    if arrow_type.startswith(("int", "uint")):
        return "int"
    return {"double": "float", "float": "float", "bool": "bool", "null": "null"}.get(arrow_type, arrow_type)


def _exact(declared: str, arrow_type: str) -> bool:
    """The arrow type is the declared one exactly (float64 is spelt double, a list's element is named; a
    string may be a large_string)."""
    if declared == "string":
        return arrow_type in ("string", "large_string")
    m = re.fullmatch(r"list<(?:\w+: )?(\w+)>", arrow_type)
    if declared.startswith("list<"):
        return m is not None and declared == f"list<{m.group(1)}>"
    return arrow_type == {"float64": "double"}.get(declared, declared)


def column_type_problem(table: str, name: str, arrow_type: str, exact: bool = True) -> str | None:
    """Why a parquet column's arrow type is not its declared one (None when it is, or may be, as declared):
    the declared type exactly (format version 2; ``exact=False``: its family, int64 and int32 alike, by
    version 1's rules)."""
    col = declared_columns(table)[name]
    want, got = col["type"], _arrow_family(arrow_type)
    if exact and _exact(want, arrow_type):
        return None
    want_family = "int" if want.startswith("int") else "float" if want.startswith("float") else want
    if got == want_family and not exact:
        return None
    as_float = arrow_type == "double" if exact else got == "float"   # a nullable int column with nulls
    if col.get("nullable") and (got == "null" or (want_family == "int" and as_float)):
        return None
    return f"column {name!r} is of arrow type {arrow_type}, the format declares {want}"


# ------------------------------------------------------------------------------------------- layout

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def device_sessions(devices: list[str], ran: set[str], restarts: int = 1) -> list[str]:
    """The ids in ``ran`` of a device's session: its name (a bundle's first run), ``<name>.s<j>`` for its
    j-th restart (0 < j < ``restarts``, format 4), then ``.r<k>`` for the k-th resume."""
    def of_device(sid: str) -> bool:
        name, sep, k = sid.rpartition(".r")
        base = name if sep and k.isdigit() else sid
        dev, sep, j = base.rpartition(".s")
        return base in devices or (bool(sep) and dev in devices and j.isdigit() and 0 < int(j) < restarts)
    return sorted(s for s in ran if of_device(s))


def layout_domains(plan: dict, ran: set[str]) -> dict[str, dict[str, list[str] | None]]:
    """Per ``required`` condition of the contract's files, the values each placeholder takes in this bundle
    (None: any one path segment). ``ran``: the sessions that children.json or a raw record shows ran."""
    devices = [d["name"] for d in plan.get("devices", [])]
    restarts = (plan.get("config") or {}).get("sessions", 1)
    anywhere = {"point": [pt["key"] for pt in plan.get("points", [])], "device": devices,
                "session": sorted(set(devices) | set(device_sessions(devices, ran, restarts))),
                "reference_device": devices[:1], "table": list(TABLES), "record": None, "online_record": None,
                "trace": [Path(t["file"]).stem for t in (plan.get("natural") or {}).get("traces", [])]}
    return {"always": anywhere, "optional": anywhere,
            "point_with_reference": {**anywhere, "point": [pt["key"] for pt in plan.get("points", [])
                                                           if pt.get("reference")]},
            "session_ran": {**anywhere, "device": [d for d in devices if d in ran],
                            "session": device_sessions(devices, ran, restarts)},
            "online": anywhere if plan.get("online") else None}   # format 5: files of the online track


def layout_required(plan: dict, ran: set[str]) -> list[str]:
    """Every path the contract requires of this bundle, in the contract's order."""
    domains, out = layout_domains(plan, ran), []
    for entry in FORMAT["files"]:
        if entry["required"] == "optional" or domains[entry["required"]] is None:
            continue
        paths = [entry["path"]]
        for name in _PLACEHOLDER.findall(entry["path"]):
            values = domains[entry["required"]][name]
            if values is None:
                raise ValueError(f"the format requires {entry['path']!r}, whose {{{name}}} has no listed values")
            paths = [p.replace(f"{{{name}}}", v, 1) for p in paths for v in values]
        out += paths
    return out


def layout_pattern(template: str, domain: dict[str, list[str] | None]) -> re.Pattern:
    """The regular expression of the paths a file template stands for in a bundle with ``domain``."""
    rx = ""
    for part in re.split(r"(\{\w+\})", template):
        m = _PLACEHOLDER.fullmatch(part)
        if m is None:
            rx += re.escape(part)
        elif domain[m.group(1)] is None:
            rx += "[^/]+"
        else:
            rx += "(?:" + "|".join(re.escape(v) for v in domain[m.group(1)]) + ")" if domain[m.group(1)] else "(?!)"
    return re.compile(rx)


def layout_strays(bundle: Path, plan: dict, sessions: set[str] = frozenset(), version: int = VERSION) -> list[str]:
    """Every file in ``bundle`` (dotfiles included) that matches no path of the contract for a bundle of format
    ``version`` (a file's ``since`` dates it later: format 15's superseded/); ``sessions``: the session ids
    children.json and the records name (a resume's job and log files)."""
    domain = layout_domains(plan, set(sessions))["optional"]
    patterns = [layout_pattern(entry["path"], domain) for entry in FORMAT["files"] if entry.get("since", 1) <= version]
    rels = [p.relative_to(bundle).as_posix() for p in sorted(Path(bundle).rglob("*")) if p.is_file()]
    return [rel for rel in rels if not any(rx.fullmatch(rel) for rx in patterns)]
