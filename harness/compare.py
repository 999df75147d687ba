"""``loopbench compare A B`` and ``loopbench show``: reading published bundles side by side.

A comparison of two bundles (two commits, two machines) is unpaired: their runs come from different
sessions, so the change is the ratio of B's median tokens/s to A's, per point and arm, with a
percentile bootstrap interval that resamples each bundle's measured runs independently
(``scipy.stats.bootstrap``, ``paired=False``). A change whose interval contains 1 is "not significant", in
the words of pyperf's ``compare_to`` (which decides by a two-sample t-test, not an interval); nothing is guessed.

Two bundles are comparable only when what they measured is the same: model (config and checkpoint
sha256), workload (config and prompts sha256), exit policy and warmup. Otherwise the comparison is
refused, naming every field that differs. An arm whose own config differs between the bundles is shown
as such and not compared.

A bundle that ``bench`` itself would not give verdicts from still has its medians and intervals shown, but
every row it is part of reads "withheld" instead of faster / slower / not significant, after a warning
line before the table that names the bundle and why (:func:`withheld`): the bundle is incomplete (an
interrupted run; its recorded ``incomplete_reasons`` are named), its verdicts are barred for another
reason (checks failed), its comparisons have fewer pairs than its verdict rule's ``min_pairs``, or its files
no longer match its ``manifest.json`` (edited since it was published; its ``audit.json`` speaks for the files as they
were). A
change between two bundles is no more trustworthy than the weaker one: an incomplete run may have lost
exactly the slow (or fast) runs, and a percentile bootstrap of a median from a handful of runs excludes 1
far too easily (``stats.verdict`` gives the reason for the minimum). The decision is the one ``bench``
recorded in ``summary.json`` (``evidence.summarize``), not a second rule.

Every interval is at the one level asked for, row by row, with no correction for multiplicity (as in
``bench``'s own verdicts, and the code has none to apply); the line after the table counts the intervals
shown, says how many would exclude no change by chance alone, and names the ``--confidence`` that would make them
a Bonferroni family at that level. The correction is left to that flag rather than applied, so that the
level printed is always the level each interval was computed at.
"""
from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats as sps

from . import evidence
from .fileio import canonical_json, sha256_bytes, try_lock
from .stats import rng_kwargs

# plan.json fields that decide what a run measured; any difference makes two bundles not comparable
SAME_FIELDS = ("config.model", "checkpoint.sha256", "config.workload", "prompts.sha256", "config.exit",
               "config.warmup")


@dataclass(frozen=True)
class Bundle:
    """A published bundle's plan, summary and arms table (one row per measured arm run)."""

    path: Path
    plan: dict
    summary: dict
    arms: pd.DataFrame

    @classmethod
    def load(cls, path: str | Path) -> "Bundle":
        """Read ``plan.json``, ``summary.json`` and ``tables/arms.parquet``; ValueError names what is missing."""
        path = Path(path)
        missing = [f for f in ("plan.json", "summary.json", "tables/arms.parquet") if not (path / f).is_file()]
        if missing and is_published(path):
            raise ValueError(f"{path} is damaged: published (a manifest.json) but without {', '.join(missing)}; "
                             f"`loopbench audit {path}` names what is wrong")
        if missing:
            raise ValueError(f"{path}: not a published bundle (no {', '.join(missing)})" + unpublished_hint(path))
        return cls(path, read_object(path / "plan.json"), read_object(path / "summary.json"),
                   pd.read_parquet(path / "tables" / "arms.parquet"))

    @functools.cached_property
    def format_version(self) -> int | None:
        """The bundle format its ``manifest.json`` records (``format_version``; version 1 wrote ``layout_version``,
        audit/FORMAT.md), None where the manifest cannot be read."""
        try:
            manifest = read_object(self.path / "manifest.json")
        except (OSError, ValueError):
            return None
        version = manifest.get("format_version", manifest.get("layout_version", 1))
        return version if isinstance(version, int) else None

    @functools.cached_property
    def changed_since_published(self) -> str | None:
        """:func:`evidence.unlike_manifest` of the bundle, hashed once (it costs a sha256 of every file)."""
        return evidence.unlike_manifest(self.path)


# what reading a bundle whose JSON documents parse but lack a field (or hold one of another type) raises
DAMAGE = (KeyError, TypeError, AttributeError, IndexError)


def read_object(path: Path) -> dict:
    """A bundle's JSON document; ValueError naming the file when it is not a JSON object (truncated, empty, a
    list), rather than the decoder's bare "Expecting value: line 1 column 1"."""
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:     # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON ({exc}); the bundle is damaged") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path} holds a JSON {type(doc).__name__}, not an object; the bundle is damaged")
    return doc


def is_published(path: Path) -> bool:
    """Whether the bundle at ``path`` is published: its ``manifest.json``, which publishing writes last and a resume
    removes first, is there (``evidence.finalize``, ``evidence.unpublish``)."""
    return (Path(path) / "manifest.json").is_file()


def unpublished_hint(path: Path) -> str:
    """For a folder with a plan but not published: how to publish it, or that its run still goes on (a controller
    holds the folder's lock, ``fileio.try_lock``; that run publishes it when it ends)."""
    if not (Path(path) / "plan.json").is_file() or is_published(path):
        return ""
    lock = try_lock(Path(path))
    if lock is None:
        return "; a controller is measuring it now (a run or a resume), and publishes it when it ends"
    os.close(lock)
    return (f"; if its run is over (its controller died), `loopbench finish {path}` publishes it as incomplete, "
            "and `resume=` measures the rest")


@functools.lru_cache(maxsize=1)
def _defaults() -> dict[str, dict]:
    """The schema's defaults of the config nodes compared, so that a key added after a bundle was written
    compares equal to its default there."""
    from . import conf

    return {"config.model": conf.to_plain(conf.ModelConf()), "config.workload": conf.to_plain(conf.WorkloadConf()),
            "config.exit": conf.to_plain(conf.ExitConf()), "arm": conf.to_plain(conf.ArmConf())}


def _get(doc: dict, dotted: str):
    for part in dotted.split("."):
        doc = doc.get(part) if isinstance(doc, dict) else None
    default = _defaults().get(dotted)
    return {**default, **doc} if default is not None and isinstance(doc, dict) else doc


def _leaf_diffs(a, b, prefix: str) -> list[str]:
    """Dotted paths (with both values) where two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _leaf_diffs(a.get(k), b.get(k), f"{prefix}.{k}")]
    return [] if a == b else [f"{prefix}: {a!r} vs {b!r}"]


def differences(a: dict, b: dict) -> list[str]:
    """Why two plans are not comparable: every differing leaf of ``SAME_FIELDS`` ([] when comparable)."""
    return [d for field in SAME_FIELDS for d in _leaf_diffs(_get(a, field), _get(b, field), field)]


def config_hash(plan: dict) -> str:
    """sha256 of the part of a plan's config that decides what is measured (``SAME_FIELDS`` of config)."""
    part = {f: _get(plan, f) for f in SAME_FIELDS if f.startswith("config.")}
    return sha256_bytes(canonical_json(part).encode())


def ratio_interval(a: np.ndarray, b: np.ndarray, confidence: float, n_resamples: int = 10_000,
                   seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of median(b) / median(a), each sample resampled on its own; None
    with fewer than two runs on either side (no interval can be formed)."""
    if len(a) < 2 or len(b) < 2:
        return None
    res = sps.bootstrap((a, b), lambda x, y, axis: np.median(y, axis=axis) / np.median(x, axis=axis),
                        paired=False, vectorized=True, confidence_level=confidence, n_resamples=n_resamples,
                        method="percentile", **rng_kwargs(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def change_words(ratio: float, ci: tuple[float, float] | None) -> str:
    """pyperf's words, decided by the interval: "1.0123x faster", "1.0500x slower" or "not significant" (the
    interval contains 1; pyperf itself decides by a t-test)."""
    if ci is None:
        return "no interval (fewer than 2 runs)"
    if ci[0] <= 1.0 <= ci[1]:
        return "not significant"
    return f"{ratio:.4f}x faster" if ratio > 1 else f"{1 / ratio:.4f}x slower"


def _reasons_text(summary: dict) -> str:
    """A summary's incomplete reasons in the report's words (a format-1 summary's are sentences already)."""
    from .report import R, reason_text

    reasons, children = summary["incomplete_reasons"], summary.get("children", [])
    return R["reason_separator"].join(r if isinstance(r, str) else reason_text(r, children) for r in reasons)


def withheld(bundle: Bundle) -> list[tuple[str, str]]:
    """Why no verdict may be read from rows of ``bundle``, as (short tag for a row, sentence for a warning);
    [] when nothing bars it.

    ``bench``'s decisions as it recorded them in ``summary.json``: its ``status`` and ``incomplete_reasons``,
    ``verdicts_published`` (format 2 on; barred by an incomplete run or failed checks), and its results'
    ``stats.n_pairs`` against its ``verdict_rule.min_pairs``, the minimum below which ``stats.verdict``
    calls a comparison inconclusive.
    """
    s, out = bundle.summary, []
    if bundle.changed_since_published:
        out.append(("changed since published", f"no longer matches its manifest.json ({bundle.changed_since_published})"
                    f", so its figures may not be the ones published; `loopbench audit {bundle.path}` names what is "
                    "wrong"))
    if s["status"] != "complete":
        out.append(("incomplete", f"is incomplete ({_reasons_text(s) or 'no reason recorded'})"))
    elif not s.get("verdicts_published", True):          # bundle formats before 2 have no such key
        barred = s.get("verdicts_barred_by") or "see its report"
        out.append((f"verdicts barred ({barred})", f"has its verdicts barred ({barred})"))
    min_pairs = s.get("verdict_rule", {}).get("min_pairs", bundle.plan["config"]["verdict"].get("min_pairs"))
    n_pairs = [r["stats"]["n_pairs"] for r in s.get("results", []) if "n_pairs" in r.get("stats", {})]
    if min_pairs is not None and n_pairs and min(n_pairs) < min_pairs:
        fewest = min(n_pairs)
        noun = "pair" if fewest == 1 else "pairs"
        out.append((f"{fewest} {noun} < min {min_pairs}",
                    f"has {fewest} {noun} in its smallest comparison, fewer than its "
                    f"verdict rule's minimum of {min_pairs} (verdict.min_pairs)"))
    return out


def _runs(bundle: Bundle) -> dict[tuple[str, str], np.ndarray]:
    """(point, arm) -> tokens/s of every measured run of that arm at that point, in any comparison."""
    return {(pt, arm): g["tokens_per_s"].to_numpy(float) for (pt, arm), g in bundle.arms.groupby(["point", "arm"])}


def compare_rows(a: Bundle, b: Bundle, confidence: float) -> list[dict]:
    """One row per (point, arm) of both bundles: medians, runs, ratio B/A, its interval and words; the words
    of a compared row read "withheld: ..." when either bundle is :func:`withheld`."""
    ra, rb = _runs(a), _runs(b)
    barred = [f"{who} {tag}" for who, bundle in (("A", a), ("B", b)) for tag, _ in withheld(bundle)]
    arms_a, arms_b = a.plan["config"]["arms"], b.plan["config"]["arms"]
    rows = []
    for key in sorted(set(ra) & set(rb)):
        pt, arm = key
        row = {"point": pt, "arm": arm, "runs_a": len(ra[key]), "runs_b": len(rb[key]),
               "a_tokens_per_s": float(np.median(ra[key])), "b_tokens_per_s": float(np.median(rb[key]))}
        arm_default = _defaults()["arm"]
        diff = _leaf_diffs({**arm_default, **arms_a[arm]}, {**arm_default, **arms_b[arm]}, f"arms.{arm}")
        if diff:
            rows.append({**row, "ratio": None, "ci": None, "words": "arm config differs: " + "; ".join(diff)})
            continue
        ratio = row["b_tokens_per_s"] / row["a_tokens_per_s"]
        ci = ratio_interval(ra[key], rb[key], confidence)
        words = "withheld: " + "; ".join(barred) if barred else change_words(ratio, ci)
        rows.append({**row, "ratio": ratio, "ci": ci, "words": words})
    return rows


def multiplicity_note(shown: int, level: float) -> str:
    """The line after the table: how many intervals were shown, each at ``level`` with no multiplicity
    correction, how many of them chance alone would put off 1, and the ``--confidence`` of a Bonferroni
    family at ``level`` (Bonferroni: k intervals each at 1 - alpha / k cover together with at least 1 - alpha)."""
    from .report import fill, level_text

    alpha = 1 - level
    if shown == 1:
        return f"1 interval shown, a {level_text(level)} interval"
    return (fill("{shown:interval|intervals} shown, each a {level} interval on its own with no multiplicity "
                 "correction: with no real change anywhere, the expected number of them that exclude no change (0%) by "
                 "chance alone is {chance:.1f} (--confidence {family} makes them a Bonferroni family at {level})",
                 shown=shown, level=level_text(level), chance=shown * alpha, family=_at_least(1 - alpha / shown)))


def _at_least(level: float) -> str:
    """``level`` written with 4 or more decimals, rounded up (never down, which would make a family level fall
    short: 1 - 0.05 / 3 = 0.98333... is 0.9834, not 0.9833) and short of 1, which ``--confidence`` refuses."""
    for decimals in range(4, 16):
        up = math.ceil(level * 10 ** decimals) / 10 ** decimals
        if up < 1:
            return f"{up:.{decimals}f}".rstrip("0")
    return repr(level)


def _pct(x: float) -> str:
    return f"{100 * (x - 1):+.2f}%"


def _identity(bundle: Bundle) -> str:
    code = bundle.plan["code"]
    sha = (code.get("git_sha") or "unknown")[:12] + ("+dirty" if code.get("git_dirty") else "")
    from .report import shown_device

    devices = ", ".join(sorted({shown_device(d["label"]) for d in bundle.plan["devices"]}))   # "CPU", "H200 #0"
    return f"{bundle.path.name} (code {sha}; {devices}; {bundle.summary['status']})"


def compare_text(a: Bundle, b: Bundle, confidence: float | None = None) -> tuple[str, bool]:
    """The comparison of B against A as text, and whether the bundles were comparable."""
    diffs = differences(a.plan, b.plan)
    head = [f"A: {_identity(a)}", f"B: {_identity(b)}"]
    if diffs:
        return "\n".join(head + ["not comparable: the bundles measured different things:"]
                         + [f"  {d}" for d in diffs]), False
    from .report import level_text

    level = confidence if confidence is not None else a.plan["config"]["verdict"]["confidence"]
    rows = compare_rows(a, b, level)
    if not rows:   # an empty table would read as a comparison; the command's status says none was made
        counts = ", ".join(f"{who} {len(bundle.arms)} measured run{'s' * (len(bundle.arms) != 1)}"
                           for who, bundle in (("A", a), ("B", b)))
        return "\n".join(head + [f"nothing to compare: no point and arm has measured runs in both bundles ({counts})"]
                          ), False
    head += [f"warning: {who} {why}; its rows read withheld, not faster or slower"
             for who, bundle in (("A", a), ("B", b)) for _, why in withheld(bundle)]
    lines = head + ["", f"tokens/s: median over each arm's measured runs; change = B / A - 1 with a {level_text(level)} "
                        "percentile bootstrap interval, resampling each bundle's runs on its own", "",
                    f"| B / C | arm | A tokens/s (runs) | B tokens/s (runs) | change [{level_text(level)} interval] | |",
                    "|---|---|---|---|---|---|"]
    points = {p["key"]: p for p in a.plan["points"]}
    for r in rows:
        pt = points[r["point"]]
        change = (f"{_pct(r['ratio'])} [{_pct(r['ci'][0])}, {_pct(r['ci'][1])}]" if r["ci"]
                  else _pct(r["ratio"]) if r["ratio"] else "-")
        lines.append(f"| {pt['max_num_seqs']} / {pt['num_requests']} | {r['arm']} | {r['a_tokens_per_s']:.2f} "
                     f"({r['runs_a']}) | {r['b_tokens_per_s']:.2f} ({r['runs_b']}) | {change} | {r['words']} |")
    shown = sum(1 for r in rows if r["ci"])
    if shown:
        lines += ["", multiplicity_note(shown, level)]
    only = sorted(set(_runs(a)) ^ set(_runs(b)))
    if only:
        lines += ["", "in one bundle only (not compared): " + ", ".join(f"{p} {arm}" for p, arm in only)]
    if {d["label"] for d in a.plan["devices"]} != {d["label"] for d in b.plan["devices"]}:
        lines += ["", "note: the bundles ran on different devices; the change includes the device's"]
    return "\n".join(lines), True


# ------------------------------------------------------------------------------------------ show

def show_text(bundle: Bundle) -> str:
    """``loopbench show BUNDLE``: identity, the result tables and the status line of a published bundle of any
    supported format (its incomplete reasons worded as :func:`withheld` words them), and the online track's line.
    """
    from . import report
    from .online.report import status_line

    s = bundle.summary
    audit = _audit_words(bundle)
    status = s["status"] + (f" ({_reasons_text(s)})" if s["incomplete_reasons"] else "")   # codes or sentences
    verdicts = {True: "published", False: "barred"}.get(s.get("verdicts_published"), "not recorded")   # see withheld
    online = status_line(bundle.path)      # the online track's line, as bench prints it (None without a track)
    return "\n".join([f"{_identity(bundle)}; {audit}", "", report.result_tables(s, bundle.plan, bundle.format_version),
                      f"status: {status}; checks {'passed' if s['checks']['ok'] else 'FAILED'}; verdicts {verdicts}",
                      *([online] if online else []), f"report: {bundle.path / 'report.md'}"])


def _audit_words(bundle: Bundle) -> str:
    """What ``audit.json`` says of ``bundle`` (its status; a failed audit's count of discrepancies and its first) and
    whether the files still match the manifest. An audit checks every file against the manifest, so one that passed
    (or found the bundle incomplete, nothing else wrong) saw no change: a change is since that audit. A failed one may
    have seen it (audit.json holds no file hashes to tell), so its words then claim no order."""
    audit_file = bundle.path / "audit.json"
    try:
        doc = read_object(audit_file) if audit_file.is_file() else None
    except ValueError:
        return "audit unreadable (audit.json is damaged; loopbench audit writes it again)"
    status = None if doc is None else doc.get("status", "?")
    words = "not audited" if doc is None else f"audit {status}"
    found = doc.get("discrepancies") if doc is not None and isinstance(doc.get("discrepancies"), list) else []
    if status == "fail" and found:
        first = str(found[0])
        first = first if len(first) <= 160 else first[:157] + "..."
        words += f" ({len(found)} discrepanc{'y' if len(found) == 1 else 'ies'}, the first: {first})"
    changed = bundle.changed_since_published
    if changed and status == "fail":
        return words + f"; its files no longer match its manifest.json ({changed})"
    if changed:   # a pass or incomplete audit.json is the verdict on the files as published, not as they are now
        return words + f", but its files changed since ({changed}): `loopbench audit {bundle.path}` checks them again"
    return words


def headline(summary: dict) -> str:
    """Every result's speedup, "<comparison> <point> 1.0049x", joined by ", " (or "no results")."""
    parts = [f"{r['comparison']} {r['point']} {r['stats']['speedup']:.4f}x" for r in summary.get("results", [])
             if r.get("stats", {}).get("speedup") is not None]
    return ", ".join(parts) or "no results"


def bundle_line(path: Path) -> str:
    """``show --all``'s line for one bundle folder: folder, the plan's name, model, status (and audit), code SHA,
    headline."""
    docs = {}
    for name in ("plan.json", "summary.json", "audit.json"):    # one damaged bundle costs its own line only
        try:
            docs[name] = read_object(path / name) if name == "plan.json" or (path / name).is_file() else None
        except (OSError, ValueError) as exc:
            return f"{path.name}: unreadable {name} ({exc.__class__.__name__})"
    plan, summary, audit_doc = docs["plan.json"], docs["summary.json"], docs["audit.json"]
    try:
        return _line(path, plan, summary, audit_doc)
    except (KeyError, TypeError, AttributeError) as exc:
        return f"{path.name}: damaged bundle ({exc.__class__.__name__}: {exc}); loopbench audit names what is wrong"


def _line(path: Path, plan: dict, summary: dict | None, audit_doc: dict | None) -> str:
    """:func:`bundle_line` of a bundle whose documents were read."""
    audited = f"audit {audit_doc.get('status', '?')}" if audit_doc is not None else "not audited"
    status = summary["status"] if summary else ("unpublished" if not is_published(path) else "?")
    code = plan.get("code", {})
    sha = (code.get("git_sha") or "unknown")[:8] + ("+dirty" if code.get("git_dirty") else "")
    preset = plan.get("checkpoint", {}).get("preset") or "checkpoint"
    results = headline(summary) if summary else "no summary"
    if summary and not summary.get("verdicts_published", True):     # bundle formats before 2 have no such key
        barred = summary.get("verdicts_barred_by") or "see its report"     # a string (bundle_format.json)
        results = f"no verdicts ({barred}); measured, not evidence: {results}"
    return f"{path.name}  {plan.get('name')}  model {preset}  {status} ({audited})  code {sha}  {results}"


def bundle_dirs(results_dir: Path) -> list[Path]:
    """The folders of ``results_dir`` that hold a ``plan.json``, oldest first (:func:`_created`): by name, a
    bundle's ``-10`` came before its ``-2`` and one commit's before an older commit's of the same day."""
    if not results_dir.is_dir():
        return []
    return sorted((p for p in results_dir.iterdir() if (p / "plan.json").is_file()), key=_created)


def _created(path: Path) -> tuple[_dt.datetime, str]:
    """A bundle's place in time: its ``plan.json`` ``created_utc``, then its folder name (the earliest
    time where the plan cannot be read or has none). Not the folder's mtime, which a copy, a checkout
    or a re-audit changes."""
    utc = _dt.timezone.utc
    try:
        created = _dt.datetime.fromisoformat(json.loads((path / "plan.json").read_text())["created_utc"])
    except (OSError, ValueError, KeyError, TypeError):
        created = _dt.datetime.min
    return (created if created.tzinfo else created.replace(tzinfo=utc)), path.name   # UTC, as the key says

