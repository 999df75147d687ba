"""Fixed schedules: a natural run captured once, then replayed by every arm.

A :class:`Schedule` records the admission order and, per request, the prompt's sha256, its bounds, the
output tokens and the exit depth of every output token, plus a hash of the per-step row trace (which
rows ran at which depth in which order). Replaying it forces the same exit depths (BRIEF section 2:
"every arm then replays those exit decisions; the model still computes its gate and tokens"); the
replay's tokens and exits are then compared with the capture by :meth:`Schedule.verify`.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, fields


class ScheduleMismatchError(ValueError):
    """A run's tokens, exit depths or row trace differ from the frozen schedule."""


def prompt_sha256(token_ids) -> str:
    return hashlib.sha256(json.dumps([int(t) for t in token_ids]).encode()).hexdigest()


def first_difference(got, want) -> tuple[int, object, object] | None:
    """``(position, wanted, got)`` at the first position where two sequences differ, ``"<end>"`` standing
    for the missing element when one is a prefix of the other; None when they are equal."""
    got, want = tuple(got), tuple(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i, b, a
    if len(got) != len(want):
        i = min(len(got), len(want))
        return i, (want[i] if i < len(want) else "<end>"), (got[i] if i < len(got) else "<end>")
    return None


# JSON value types of a field's annotation (the annotations are strings here: ``from __future__ import annotations``).
# bool is refused where a number is meant (json true is a Python int), and an int is a float's whole value.
_JSON_TYPES = {"int": (int,), "float": (int, float), "str": (str,)}


def _json_type_ok(value, name: str) -> bool:
    return isinstance(value, _JSON_TYPES[name]) and not isinstance(value, bool)


def _check_fields(raw, kind: type, where: str) -> None:
    """ValueError unless ``raw`` (parsed JSON) is an object with exactly the fields of dataclass ``kind``, each of
    its tuple fields a JSON array (else a dict's keys or a string's characters would be taken for its items), and
    each scalar, and each item of an array of scalars, of its annotated type (else a damaged file fails mid-run: an
    exit depth of 2.5 is one no loop reaches)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(raw).__name__}")
    names = [f.name for f in fields(kind)]
    missing = [n for n in names if n not in raw]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(map(repr, missing))}")
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise ValueError(f"{where} has unknown field {', '.join(map(repr, unknown))}")
    for f in fields(kind):
        value, annotation = raw[f.name], str(f.type)
        item = re.fullmatch(r"tuple\[(\w+), \.\.\.\]", annotation)
        if item is None:
            if not _json_type_ok(value, annotation):
                raise ValueError(f"{where} field {f.name!r} must be a JSON {annotation}, got {value!r}")
        elif not isinstance(value, list):
            raise ValueError(f"{where} field {f.name!r} must be a JSON array, got {type(value).__name__}")
        elif item.group(1) in _JSON_TYPES:
            bad = next((i for i, v in enumerate(value) if not _json_type_ok(v, item.group(1))), None)
            if bad is not None:
                raise ValueError(f"{where} field {f.name!r} item {bad} must be a JSON {item.group(1)}, "
                                 f"got {value[bad]!r}")


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    prompt_sha256: str
    prompt_len: int
    max_tokens: int
    min_loops: int
    max_loops: int
    exit_threshold: float
    token_ids: tuple[int, ...]
    exit_depths: tuple[int, ...]


@dataclass(frozen=True)
class Schedule:
    version: int
    max_num_seqs: int
    admission_order: tuple[str, ...]
    requests: tuple[ScheduledRequest, ...]
    num_steps: int
    trace_sha256: str

    FORMAT_VERSION = 1

    def by_id(self) -> dict[str, ScheduledRequest]:
        return {r.request_id: r for r in self.requests}

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=1)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        """The schedule ``to_json`` wrote; ValueError naming the version, or the fields missing or unknown."""
        raw = json.loads(text)
        version = raw.get("version") if isinstance(raw, dict) else None
        if version != cls.FORMAT_VERSION:
            raise ValueError(f"schedule format version {version!r}, expected {cls.FORMAT_VERSION} (a JSON object)")
        _check_fields(raw, cls, "schedule")
        for i, r in enumerate(raw["requests"]):
            _check_fields(r, ScheduledRequest, f"schedule request {i}")
        reqs = tuple(ScheduledRequest(**{**r, "token_ids": tuple(r["token_ids"]),
                                         "exit_depths": tuple(r["exit_depths"])}) for r in raw["requests"])
        return cls(version=raw["version"], max_num_seqs=raw["max_num_seqs"],
                   admission_order=tuple(raw["admission_order"]), requests=reqs,
                   num_steps=raw["num_steps"], trace_sha256=raw["trace_sha256"])

    @classmethod
    def from_run(cls, runs, *, max_num_seqs: int, num_steps: int, trace_sha256: str) -> "Schedule":
        """Freeze a drained natural run: ``runs`` is (Request, RequestOutput) per request in admission order."""
        reqs = tuple(ScheduledRequest(request_id=req.request_id, prompt_sha256=prompt_sha256(req.prompt_token_ids),
                                      prompt_len=len(req.prompt_token_ids), max_tokens=req.max_tokens,
                                      min_loops=req.min_loops, max_loops=req.max_loops,
                                      exit_threshold=req.exit_threshold, token_ids=out.token_ids,
                                      exit_depths=out.exit_depths) for req, out in runs)
        return cls(version=cls.FORMAT_VERSION, max_num_seqs=max_num_seqs,
                   admission_order=tuple(req.request_id for req, _ in runs), requests=reqs,
                   num_steps=num_steps, trace_sha256=trace_sha256)

    def check_fits(self, request) -> ScheduledRequest:
        """The schedule entry for ``request`` (an engine Request); ValueError naming what differs."""
        entry = self.by_id().get(request.request_id)
        if entry is None:
            raise ValueError(f"schedule does not fit: request {request.request_id!r} is not in the schedule")
        mine = (prompt_sha256(request.prompt_token_ids), len(request.prompt_token_ids), request.max_tokens,
                request.min_loops, request.max_loops, request.exit_threshold)
        theirs = (entry.prompt_sha256, entry.prompt_len, entry.max_tokens, entry.min_loops,
                  entry.max_loops, entry.exit_threshold)
        names = ("prompt sha256", "prompt length", "max_tokens", "min_loops", "max_loops", "exit_threshold")
        for name, a, b in zip(names, mine, theirs):
            if a != b:
                raise ValueError(f"schedule does not fit: request {request.request_id!r} has {name} {a!r}, "
                                 f"the schedule has {b!r}")
        # a depth no loop reaches would only show mid-run, as a row the replay never lets exit
        for i, depth in enumerate(entry.exit_depths):
            if not 1 <= depth <= entry.max_loops:
                raise ValueError(f"schedule is damaged: request {request.request_id!r} has exit depth {depth!r} at "
                                 f"token {i}, outside 1..{entry.max_loops} (its max_loops)")
        return entry

    def verify(self, outputs: dict, trace_sha256: str | None = None) -> None:
        """Raise ScheduleMismatchError naming the first differing request, position and field."""
        mine = self.by_id()
        if set(outputs) != set(mine):
            raise ScheduleMismatchError(
                f"requests differ: missing {sorted(set(mine) - set(outputs))}, extra {sorted(set(outputs) - set(mine))}")
        for rid, ref in mine.items():
            out = outputs[rid]
            for field in ("token_ids", "exit_depths"):
                diff = first_difference(getattr(out, field), getattr(ref, field))
                if diff is not None:
                    i, want, got = diff
                    raise ScheduleMismatchError(
                        f"request {rid!r} {field}[{i}] = {got!r}, frozen schedule has {want!r}")
        if trace_sha256 is not None and trace_sha256 != self.trace_sha256:
            raise ScheduleMismatchError("row trace differs from the frozen schedule (batch composition changed)")
