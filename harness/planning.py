"""``loopbench plan`` and a multirun's up-front check: a configuration validated, its plan printed,
nothing created (no bundle, no cache entry, no Hydra folder).

The estimated duration comes from the wall times of the most recent earlier bundle in ``results_dir`` (by
its ``plan.json`` ``created_utc``, then folder name; never folder times, which a copy or checkout changes)
that measured the same thing (``compare.differences``) on the same kind of devices: its reference
child's wall time, and per point the median of an arm run's warmup + measured seconds, plus a session's fixed cost
(model load, engine builds: the median over its sessions of a session's wall time minus the runs it measured) for
each session (restart) the plan runs on a device. Without such a
bundle the estimate is unknown, and the plan says so rather than guess.

With ``resume=<bundle>`` the plan runs every check the resume would make before changing anything
(``resume.check_resume``: a refusal is the same one line and exit 2 as ``loopbench bench``'s) and, in
place of the fresh measurement order, says what the resume would do: arms kept, arms left, lone records kept
as superseded (measured again with their partner, out of every figure); its estimate is of the arms left (the bundle's references are frozen).

The session timeout (:func:`session_timing`). A session child is killed at ``executor.session_timeout_s``
whatever it has left (harness/executors.py), so a plan whose session cannot finish in time would measure for
that long and then lose the arm in flight and every arm after it. The estimate of one session (its fixed cost
plus its arm runs, the longest session of a device) is compared with that timeout before anything is measured:

- estimate > ``TIMEOUT_MARGIN`` x timeout: refused (``loopbench plan`` and ``bench`` exit 2, one line naming
  both figures, the bundle the estimate comes from and what to change);
- estimate > timeout / ``TIMEOUT_MARGIN``: a warning (plan's text, bench's stderr), nothing refused;
- no estimate (no earlier bundle of the same model, workload and devices): nothing is compared, and plan says so.

Why a refusal only past a margin, and why this one: the estimate rests on one earlier bundle's wall times (per
point the median warmup + measured seconds of an arm run, a session's fixed cost as the median over its
sessions), measured on the same device labels but under whatever load that machine had then; runs on one idle
machine agree within a few percent, while two runs on a shared one have differed by a third or more (README,
"Compare two commits"). At 1.25 x the timeout a session is killed unless this run is at least 20% faster than the
one the estimate comes from, far beyond idle-machine noise, so refusing is right there; the cost of a false
refusal is one override (a larger timeout, or more sessions with fewer pairs each), the cost of a missed one is
the whole run's time. Between timeout / 1.25 and 1.25 x timeout the outcome depends on the load: a warning. A
resume is only warned (its session timeout may be raised, as a limit that changes no measurement: resume.LIMITS),
and a killed session's arms are kept; the next resume measures the rest.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from . import compare, conf, inputs, natural, progress
from .plan import detectable_effect, measurement_order
from .stats import restart_of

CONFIG_ERRORS = (ValueError, TypeError, HydraException, OmegaConfBaseException)


class SweepError(Exception):
    """A job of a sweep whose configuration is bad: ``job`` names it (number and overrides), or is None where no
    override makes the job (the preset alone: its error, or a preset that does not compose, whose sweep is unread)."""

    def __init__(self, job: str | None, cause: Exception):
        super().__init__(f"sweep job {job}: {cause}" if job else str(cause))
        self.job, self.cause = job, cause

    @property
    def where(self) -> str:
        """" in sweep job N of M (...)" for the one-line refusal; "" where no job is to blame."""
        return f" in sweep job {self.job}" if self.job else ""


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The override list of every job of a Hydra multirun (``KEY=A,B`` sweeps; Hydra's basic sweeper). ``overrides``
    hold the preset's own sweep first (:func:`conf.sweeper_params`), as the sweeper reads them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, max_batch_size=None) for job in batch]


def check(config_name: str, overrides: list[str], warn: Callable[[str], None] | None = None):
    """Compose, validate and check one job against its model and devices, and its sessions against
    ``executor.session_timeout_s`` (:func:`session_timing`); (spec, inputs). Raises one of ``CONFIG_ERRORS``
    naming the key (a ValueError naming the timeout and the estimate when a session cannot finish in time);
    ``warn`` gets the warning of a session close to its timeout."""
    spec, got, _ = _checked(config_name, overrides, warn)
    return spec, got


def _checked(config_name: str, overrides: list[str], warn: Callable[[str], None] | None = None):
    """:func:`check`, and the earlier bundle its estimates come from (None: none); a resume's timing is left to
    :func:`plan_text`, which knows the arms it has left."""
    spec = conf.validate(conf.compose(config_name, overrides))
    got = inputs.gather(spec)
    earlier = _earlier_for(spec, got)
    if spec.resume is None:
        timing = session_timing(spec, earlier)
        if timing.refused:
            raise ValueError(timing.refusal())
        if warn is not None and timing.warning() is not None:
            warn(timing.warning())
    return spec, got, earlier


def warn_on_stderr(prefix: str = "") -> Callable[[str], None]:
    """A ``warn`` for :func:`check`: ``loopbench: warning: <prefix><text>`` on stderr (never silenced by --quiet:
    it says the run may be killed)."""
    return lambda text: print(f"loopbench: warning: {prefix}{text}", file=sys.stderr, flush=True)


def preset_holding(config_name: str, exc: Exception) -> str:
    """`` in configs/<preset>.yaml`` when the bad value that ``exc`` (raised by :func:`check` for ``config_name`` and
    some overrides) names is a preset's own: the first of ``conf.preset_files(config_name)`` (a preset after the
    ones it extends) that, composed alone without overrides, is refused with the same message, provided
    ``config_name`` alone is too. "" when none is: the value came from an override (whose text the user has in
    front of them; also where a preset that ``config_name`` extends holds the same bad value, which
    ``config_name`` overrides), or from an override meeting a preset's value; and for an error of composition (a
    misspelt key or a wrong type, whose messages name the file already). Composes and checks each preset again, so it
    is for the error path only."""
    if not isinstance(exc, (ValueError, TypeError)) or isinstance(exc, (HydraException, OmegaConfBaseException)):
        return ""
    *extended, own = conf.preset_files(config_name)     # ``config_name`` comes last
    if not _refused_alike(own, exc):
        return ""   # the run's preset alone is fine: an override set the value (a preset it extends may hold the
        # same bad value, but the run's preset overrides that one, so fixing that file would change nothing)
    holder = next((preset for preset in extended if _refused_alike(preset, exc)), own)
    return f" in {conf.CONFIG_DIR.name}/{holder}.yaml"


def _refused_alike(preset: str, exc: Exception) -> bool:
    """Whether ``preset`` composed alone, without overrides, is refused by the checks with ``exc``'s message (not
    one that composition refuses: a misspelt key or a wrong type, whose messages name the file themselves)."""
    try:
        cfg = conf.compose(preset, [])
    except CONFIG_ERRORS:
        return False
    try:
        conf.validate(cfg)
    except CONFIG_ERRORS as own:
        return str(own) == str(exc)
    return False


def check_sweep(config_name: str, overrides: list[str]) -> list[list[str]]:
    """Every job's overrides of a multirun, each checked (:func:`check`); SweepError names the first bad one
    (numbered from 1, as the sweep's progress lines number them)."""
    return [job for job, _ in _checked_jobs(config_name, overrides)]


def sweep_arm_runs(config_name: str, overrides: list[str], warn: bool = False) -> list[int]:
    """Each job's measured arm runs per device (its measurement order), checked as :func:`check_sweep`;
    ``warn``: a job's session-timeout warning on stderr, naming the job."""
    return [len(measurement_order(spec)) for _, spec in _checked_jobs(config_name, overrides, warn)]


def job_name(i: int, jobs: list[list[str]]) -> str | None:
    """Job ``i`` (from 0) of a sweep as its refusals and plans name it: "2 of 2 (pairs=0)", the overrides that set it
    apart from the others (all of its own where none does); None for a job of no override: the preset alone (or one
    that does not compose, so that its own sweep could not be read)."""
    job = jobs[i]
    if not job:
        return None
    swept = [o for o in job if not all(o in other for other in jobs)]
    return f"{i + 1} of {len(jobs)} ({' '.join(swept or job)})"


def _checked_jobs(config_name: str, overrides: list[str], warn: bool = False) -> list[tuple[list[str], object]]:
    try:
        try:
            # a preset's hydra.sweeper.params sweep too: Hydra puts them before the command line's (which win)
            jobs = sweep_jobs([*conf.sweeper_params(config_name), *overrides])
        except HydraException:
            conf.check_override_syntax(overrides)   # a key Hydra's lexer refuses, in our words where we have them
            raise
    except CONFIG_ERRORS as exc:
        raise SweepError("(the sweep's overrides)", exc) from exc
    checked = []
    for i, job in enumerate(jobs):
        name = job_name(i, jobs)
        try:
            prefix = f"sweep job {name}: " if name else ""
            checked.append((job, check(config_name, job, warn_on_stderr(prefix) if warn else None)[0]))
        except CONFIG_ERRORS as exc:
            raise SweepError(name, exc) from exc
    return checked


def _earlier_bundle(results_dir: Path, plan_like: dict) -> compare.Bundle | None:
    """The most recent complete bundle of ``results_dir`` (by compare.bundle_dirs: its plan's creation time; of
    two created in the same second, the later folder name) that measured what ``plan_like`` would, on the same device labels
    (None when there is none)."""
    labels = {d["label"] for d in plan_like["devices"]}
    for path in reversed(compare.bundle_dirs(results_dir)):
        try:
            b = compare.Bundle.load(path)
            same_devices = {d["label"] for d in b.plan["devices"]} == labels
            if same_devices and b.summary["status"] == "complete" and not compare.differences(b.plan, plan_like):
                return b
        except (ValueError, OSError, *compare.DAMAGE):
            continue     # a damaged bundle gives no estimate; it is no fault of the configuration planned
    return None


def estimate_s(earlier: compare.Bundle, order: list, sessions: int = 1) -> tuple[float, float]:
    """(reference capture s, one device's sessions s) for ``order``, which one device measures in ``sessions``
    session processes (restarts), from ``earlier``'s wall times: each arm run of ``order`` at its point's median
    warmup + measured seconds in ``earlier``, plus ``sessions`` times one session's fixed cost (model load, engine
    builds). That cost is, per session of ``earlier`` whose wall time is known, its wall time less the arm runs it
    measured (``tables/arms.parquet`` names each run's session), and the median of those: a bundle has several
    sessions per device where it planned restarts or was resumed, and one whose controller died has lost the
    first one's wall time."""
    ref, fixed, run_of = _costs(earlier)
    return ref, sessions * fixed + sum(run_of(item) for item in order)


def _costs(earlier: compare.Bundle) -> tuple[float, float, Callable]:
    """(reference capture s, one session's fixed cost s, arm run s of an order item) from ``earlier``'s wall times
    (:func:`estimate_s`)."""
    arms = earlier.arms
    run_s = arms["warmup_elapsed_s"].fillna(0) + arms["elapsed_s"]
    per_point = run_s.groupby(arms["point"]).median()
    fallback = float(run_s.median())
    children = earlier.summary["children"]
    measured_in = arms["session"] if "session" in arms else arms["job"]   # bundles before sessions were named
    fixed = [max(0.0, c["wall_s"] - float(run_s[measured_in == c.get("session", c["name"])].sum()))
             for c in children if c["name"] != "reference" and c.get("wall_s")]
    ref = sum(c["wall_s"] or 0.0 for c in children if c["name"] == "reference")
    return ref, float(pd.Series(fixed).median()) if fixed else 0.0, lambda item: float(per_point.get(item.point,
                                                                                                       fallback))


def longest_session_s(earlier: compare.Bundle, order: list, pairs_per_session: int) -> float:
    """The estimated wall time of the longest session child that measures ``order`` (one device's items, over its
    restarts: ``stats.restart_of``), each session its fixed cost plus its own arm runs (:func:`estimate_s`'s
    figures). A session child, not the device's whole order, is what ``executor.session_timeout_s`` bounds."""
    _, fixed, run_of = _costs(earlier)
    per_session: dict[int, float] = {}
    for item in order:
        r = restart_of(item.pair, pairs_per_session)
        per_session[r] = per_session.get(r, fixed) + run_of(item)
    return max(per_session.values(), default=fixed)


TIMEOUT_MARGIN = 1.25   # refuse past margin x timeout, warn past timeout / margin (module docstring: why)


@dataclass(frozen=True)
class SessionTiming:
    """A plan's longest session against ``executor.session_timeout_s`` (module docstring, "The session timeout").
    ``estimate_s`` None: no earlier bundle to estimate from, nothing compared."""

    timeout_s: float
    estimate_s: float | None
    source: str | None          # the earlier bundle's folder name
    resuming: bool = False

    @property
    def refused(self) -> bool:
        return not self.resuming and self.estimate_s is not None and self.estimate_s > TIMEOUT_MARGIN * self.timeout_s

    @property
    def close(self) -> bool:
        return self.estimate_s is not None and self.estimate_s > self.timeout_s / TIMEOUT_MARGIN

    def needed_s(self) -> int:
        """The least whole-second timeout that this plan is not warned about."""
        return math.ceil(self.estimate_s * TIMEOUT_MARGIN)

    def _figures(self) -> str:
        words = progress.duration(self.timeout_s)
        own = f" ({words})" if words != f"{self.timeout_s:.0f} s" else ""
        return (f"executor.session_timeout_s = {self.timeout_s:g} s{own}, but the "
                f"longest session is estimated at about {progress.duration(self.estimate_s)} "
                f"({self.estimate_s / self.timeout_s:.0%} of it; from {self.source})")

    def refusal(self) -> str:
        return (f"{self._figures()}, so it would be killed mid-run; raise executor.session_timeout_s to at least "
                f"{self.needed_s()}, or measure fewer arms per session (sessions=k with pairs divided by k, or fewer "
                f"pairs, points or comparisons)")

    def warning(self) -> str | None:
        if not self.close:
            return None
        if self.resuming:
            return (f"{self._figures()}: a session may be killed mid-run (the arms it records are kept); to be safe "
                    f"raise executor.session_timeout_s, which a resume may change, to at least {self.needed_s()}")
        return (f"{self._figures()}: a session may be killed mid-run, depending on this run's speed; to be safe "
                f"raise executor.session_timeout_s to at least {self.needed_s()}")

    def line(self) -> str:
        """plan's line."""
        if self.estimate_s is None:
            return (f"  session timeout: {self.timeout_s:g} s; not compared with the sessions (their duration is "
                    "unknown)")
        if self.close:
            return f"  warning: {self.warning()}"
        return (f"  session timeout: {self.timeout_s:g} s; the longest session is estimated at about "
                f"{progress.duration(self.estimate_s)} ({self.estimate_s / self.timeout_s:.0%} of it)")


def session_timing(spec, earlier: compare.Bundle | None, order: list | None = None) -> SessionTiming:
    """The plan's :class:`SessionTiming`: its longest session (``order``: the device items it measures, by default
    the whole measurement order) estimated from the earlier bundle ``earlier`` (:func:`_earlier_for`; None: none)."""
    order = measurement_order(spec) if order is None else order
    timeout = float(spec.executor.session_timeout_s)
    if earlier is None:
        return SessionTiming(timeout, None, None, spec.resume is not None)
    return SessionTiming(timeout, longest_session_s(earlier, order, spec.pairs), earlier.path.name,
                         spec.resume is not None)


_n = progress.counted   # "1 point", "2 points"


def _order_lines(spec, order) -> list[str]:
    """One line per point and pair: each comparison's two arms in their measured order."""
    lines, key = [], None
    for item in order:
        if item.slot == 0:
            line = f"    {item.point} pair {item.pair}:" if key != (item.point, item.pair) else line
            key = (item.point, item.pair)
            first = item
        else:
            aa = first.arm == item.arm     # an A/A pair: say which engine is the baseline's
            names = [f"{it.arm} ({it.position})" if aa else it.arm for it in (first, item)]
            line += f"  {item.comparison} [{names[0]} -> {names[1]}]"
            if item.comparison == spec.comparisons[-1].name:
                lines.append(line)
    return lines


def _resume_lines(check) -> list[str]:
    """What a resume would do (``resume.ResumeCheck``), in place of the fresh measurement order."""
    state = ("published incomplete" if check.status == "incomplete" else
             "unpublished: its controller died (the resume marks its running children lost)" if check.status is None
             else f"published, status {check.status}")
    per_device = "; ".join(f"{name} seqs {seqs[0]}-{seqs[-1]}" if seqs else f"{name} none"
                           for name, seqs in check.todo.items())
    lines = [f"  resume: {check.bundle} ({state}); this run's plan and environment are the bundle's",
             f"  resume keeps {check.kept} of {check.planned} arms, {check.left} to measure ({per_device}), on the "
             "bundle's frozen references, in its planned order"]
    if check.online_planned:
        lines.append(f"  resume runs {check.online_left} of the online track's {check.online_planned} runs (those "
                     "not recorded, and a pair's lone run again with its partner)")
    if not check.checkpoint_compared:
        lines.append("  resume: checkpoint not compared yet (the synthetic checkpoint is not in the cache and plan "
                     "writes none; bench synthesizes it and refuses the resume if its sha256 differs)")
    if check.lone:
        lines.append(f"  resume keeps {_n(len(check.lone), 'lone record')} (of a pair whose other arm was not recorded, "
                     "measured again) as superseded, out of every figure: "
                     + ", ".join(f"{src.relative_to(check.bundle)} -> {dst.relative_to(check.bundle)}"
                                 for src, dst in check.superseded))
    else:
        lines.append("  resume supersedes no records")
    lines += [f"  resume runs its children under {limit} (a limit changes no measurement)" for limit in check.limits]
    return lines


def plan_text(config_name: str, overrides: list[str]) -> str:
    """The plan of one configuration as text (nothing is written); raises one of ``CONFIG_ERRORS``
    (``resume.ResumeRefused`` among them, a ValueError, when ``resume=`` names a bundle a resume refuses)."""
    spec, got, earlier = _checked(config_name, overrides)
    order = measurement_order(spec)
    resuming = None
    if spec.resume is not None:
        from .resume import check_resume   # imports the controller: only when resuming

        resuming = check_resume(spec, got)
    plain = spec.to_plain()
    m, wl, ex = plain["model"], plain["workload"], plain["exit"]
    if spec.model.checkpoint:
        model = f"checkpoint {spec.model.checkpoint}"
    else:
        cached = (inputs.synthetic_checkpoint_path(spec, got.cache) / "config.json").is_file()
        model = (f"synthetic {m['preset']} (seed {m['seed']}), "
                 + ("cached" if cached else f"to be synthesized once into {got.cache}"))
    prompts = wl["prompts_file"] or (",".join(map(str, wl["prompt_lens"])) + " cycled" if wl["prompt_lens"]
                                     else str(wl["prompt_len"]))
    n_comp = len(spec.comparisons)
    lines = [f"plan: {spec.name} (preset {config_name}; {_n(len(overrides), 'override')})",
             f"  model: {model}; {m['dtype']}",
             f"  workload: prompt tokens {prompts}; {wl['output_len']} output tokens; exit {ex['policy']} "
             f"{ex['threshold']}/min{ex['min_loops']}/max{ex['max_loops']}",
             f"  devices: {', '.join(d['label'] for d in got.devices)} ({_n(spec.sessions, 'session')} each, "
             f"the same order)",
             *_executor_lines(plain["executor"]),
             f"  points: {', '.join(_point_text(p) for p in spec.points)}",
             f"  comparisons: {', '.join(c.name + (' (A/A)' if c.baseline == c.candidate else '') for c in spec.comparisons)}",
             f"  arms: {len(order)} measured runs per device = {_n(len(spec.points), 'point')} x "
             f"{_n(n_comp, 'comparison')} x {_n(spec.pairs, 'pair')} x {_n(spec.sessions, 'session')} x 2 arms, each after {'one untimed warmup' if spec.warmup else 'no warmup'}; "
             f"reference arm {spec.reference} ("
             + ("frozen in the bundle)" if resuming else "natural run per point, reused from the cache when its inputs match)")]
    if resuming is None:
        lines += ["  measurement order (each pair's two arms, balanced and seeded):", *_order_lines(spec, order)]
    else:
        lines += _resume_lines(resuming)
        # devices measure side by side: the resume lasts as long as the device with the most arms left
        order = [order[seq] for seq in max(resuming.todo.values(), key=len, default=())]
    from .online.plan import describe as describe_online   # the online track's line, when there is one

    timing = session_timing(spec, earlier, order)
    return "\n".join(lines + [_estimate_line(spec, order, earlier, resuming is not None), timing.line(),
                              _effect_line(spec)]
                     + _verdict_line(spec) + natural_lines(plain, spec) + describe_online(spec))


def _executor_lines(ex: dict) -> list[str]:
    """Where the children run, when not as local processes: SLURM jobs through sbatch (README, "On a SLURM
    cluster"), or submitit's local / debug executor."""
    if ex["kind"] != "slurm":
        return []
    sl = ex["slurm"]
    if sl["cluster"] not in (None, "slurm"):
        return [f"  executor: submitit's {sl['cluster']} executor (executor.kind=slurm, executor.slurm.cluster="
                f"{sl['cluster']}): the reference capture and each session as a job on this host, no SLURM"]
    asks = [f"{key} {sl[key]}" for key in ("partition", "account") if sl[key]] or ["the cluster's default partition"]
    asks += [_n(sl["cpus_per_task"], "CPU") + " per task"] + ([f"{sl['mem_gb']} GB"] if sl["mem_gb"] is not None else [])
    limit = f"{sl['time_limit_min']} min" if sl["time_limit_min"] else "each child's timeout"
    return [f"  executor: SLURM (executor.kind=slurm): bench submits the reference capture and each session as a job "
            f"with sbatch ({', '.join(asks)}, time limit {limit}); plan submits nothing"]


def _point_text(pt) -> str:
    """"B16/C16", with the point's own workload: "B16/C16 P2048/D64" (harness/workloads.py)."""
    own = " ".join(f"{n}{v}" for n, v in (("P", pt.prompt_len), ("D", pt.output_len)) if v is not None)
    return f"B{pt.max_num_seqs}/C{pt.num_requests}" + (f" {own.replace(' ', '/')}" if own else "")


def natural_lines(plain: dict, spec) -> list[str]:
    """The natural track's traced runs and declared rule (harness/natural.py), when the plan has one."""
    entry = natural.plan_entry(plain, [p.key for p in spec.points])
    if not entry["comparisons"]:
        return []
    return [f"  natural track: {', '.join(entry['comparisons'])} run their own exits (no replay); "
            f"{_n(len(entry['traces']), 'untimed traced run')} before measuring",
            f"  natural equivalence rule: {entry['rule']}"]


def _effect_line(spec) -> str:
    """The plan's minimum detectable effect (``plan.detectable_effect``, the figure plan.json records)."""
    eff = detectable_effect(spec)
    n, alpha, power = eff["n_pairs"], eff["alpha"], eff["power"]
    if eff["mde_relative"] is None:
        return (f"  detectable effect: unknown ({_n(n, 'pair')} per comparison; no noise estimate: set "
                f"evidence.noise_bundle or evidence.noise_sigma)")
    return (f"  detectable effect: {eff['mde_relative']:+.2%} speedup ({_n(n, 'pair')} per comparison, alpha "
            f"{alpha:.2g}, power {power:.0%}, noise sigma {eff['noise']['sigma_log_ratio']:.3g} "
            f"({eff['noise']['source']}))")


def _verdict_line(spec) -> list[str]:
    """A warning when the design cannot give a verdict whatever it measures (none when it can): fewer pairs per
    comparison than ``verdict.min_pairs``, or so few that the exact two-sided signed-rank p, at least 2 / 2^n
    (every pair one way), cannot fall below 1 - ``verdict.confidence`` (the verdict rule, ``stats.verdict``)."""
    n, vd = detectable_effect(spec)["n_pairs"], spec.verdict
    alpha, floor_p = 1 - vd.confidence, 2 / 2 ** n
    if n < vd.min_pairs:
        why = f"fewer than verdict.min_pairs = {vd.min_pairs}"
    elif not floor_p < alpha:
        why = (f"so the signed-rank p is at least 2 / 2^{n} = {floor_p:.3g}, never below 1 - verdict.confidence = "
               f"{alpha:.3g}")
    else:
        return []
    return [f"  verdicts: none possible: {_n(n, 'pair')} per comparison, {why}; every result will read inconclusive"]


def _earlier_for(spec, got) -> compare.Bundle | None:
    """The earlier bundle the plan's estimates come from (:func:`_earlier_bundle`), None when there is none or the
    checkpoint cannot be hashed without writing it."""
    from .fileio import sha256_bytes

    plan_like = {"config": spec.to_plain(), "devices": got.devices,
                 "prompts": {"sha256": sha256_bytes(got.prompts_text.encode())},
                 "checkpoint": {"sha256": _cached_checkpoint_sha(spec, got)}}
    return _earlier_bundle(inputs.results_path(spec), plan_like) if plan_like["checkpoint"]["sha256"] else None


def _estimate_line(spec, order, earlier: compare.Bundle | None, resuming: bool = False) -> str:
    results = inputs.results_path(spec)
    if earlier is None:
        return (f"  estimated duration: unknown (no complete earlier bundle of this model, workload and devices in "
                f"{results}; one run gives the figures)")
    restarts = len({restart_of(item.pair, spec.pairs) for item in order}) or 1   # each a fresh process
    ref_s, sessions_s = estimate_s(earlier, order, restarts)
    if resuming and not order:   # only sessions that measure no arm (the online runs left, or children to complete)
        return (f"  estimated duration: about {progress.duration(sessions_s)} for a session with no arms left to "
                f"measure (one session's cost beyond its arms in {earlier.path.name}: model load, engine builds and "
                "whatever it ran besides, such as the online track's runs), plus set-up and audit")
    if resuming:   # the bundle's references are frozen: no capture
        return (f"  estimated duration: about {progress.duration(sessions_s)} of measuring the arms left, plus "
                f"set-up and audit; from {earlier.path.name}")
    return (f"  estimated duration: about {progress.duration(ref_s + sessions_s)} of measuring (reference "
            f"{progress.duration(ref_s)} unless reused, sessions {progress.duration(sessions_s)}), plus set-up and "
            f"audit; from {earlier.path.name}")


def _cached_checkpoint_sha(spec, got) -> str | None:
    """The checkpoint's sha256 where it can be had without writing anything: a real checkpoint, or the
    cached synthetic one (its sha256 is the cached bundles' ``checkpoint.sha256``)."""
    from loopbench.runtime.checkpoint import checkpoint_sha256

    path = inputs.checkpoint_path(spec) or inputs.synthetic_checkpoint_path(spec, got.cache)
    return checkpoint_sha256(path) if (path / "config.json").is_file() else None
