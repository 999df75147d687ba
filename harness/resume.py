"""Finish or resume an incomplete bundle (issue 8, items 4 and 5).

- :func:`finish`: a bundle whose controller died without publishing (SIGKILL, a lost machine) has a
  plan, raw records and a ``children.json`` that still lists its children as ``running``. ``finish``
  marks those children ``interrupted`` (``interrupted_by: "lost"``), sweeps the temporary files of
  killed writers and publishes the bundle as incomplete, exactly as a controller that was stopped by
  SIGTERM would have: completed arms intact, no verdict. Only the code that measured the bundle (the same
  ``code_sha256``) publishes it; other code is refused before anything changes.
- :func:`resume` (``resume=<bundle>`` in the config): a new run continues an incomplete bundle. Its
  plan is rebuilt from this run's config, code, checkpoint, prompts and devices and must equal the
  bundle's frozen plan (every key but the creation time, the config's ``resume`` and ``results_dir``,
  which only say where bundles lie, and the limits of :data:`LIMITS`, which only say when a child is killed; the
  environment's library versions and devices too); any difference is refused, naming it, before anything is changed or
  measured. Completed pairs are kept; an arm whose partner was not recorded is measured again with it (a pair is
  two back-to-back arms of one session; so is an online run whose pair's other run was not recorded), its record
  kept, out of every figure, under superseded/ (bundle format 15, harness/superseded.py: nothing measured is lost),
  and the rest of each device's planned order is measured by a
  new session child ``<name>.r<k>`` per restart left (``<name>.s<j>.r<k>``, controller.run_restarts), which reuses the bundle's frozen references (never recaptured)
  and continues the same seeded order. Every record names the session that measured it and
  ``children.json`` lists every session of every run. A complete bundle is never resumed.
- :func:`check_resume`: every check a resume makes before it changes anything, and what it would then
  do (arms kept, arms left, records superseded), without holding the locks and without writing; ``resume``
  runs it under its lock and ``loopbench plan resume=<bundle>`` prints it, so the two cannot disagree.

Both take the bundle's locks first (:func:`evidence.try_lock`): the bundle folder, held by a live
controller, and ``jobs/``, held by a live child; while either is held they refuse.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from . import cards, evidence, identity, inputs, machine, progress, superseded
from .controller import (RunResult, make_cache, make_executor, prepare_checkpoint, publish, published, run_restarts,
                         unless_stopped, write_children)
from .executors import StopSignals
from .fileio import sha256_file, try_lock
from .plan import make_plan, point_entries
from .spec import BenchSpec

# how long finish / resume wait for the children of a dead controller to exit (Linux SIGTERMs them at once)
CHILD_EXIT_WAIT_S = 30.0
MAX_LISTED = 6


def _differences(old, new, path: str = "") -> list[tuple[str, object, object]]:
    """(dotted path, bundle's value, this run's value) for every leaf where two JSON documents differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            out += _differences(old.get(key, "<absent>"), new.get(key, "<absent>"), f"{path}.{key}" if path else key)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in _differences(a, b, f"{path}[{i}]")]
    return [] if type(old) is type(new) and old == new else [(path, old, new)]


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# plan.json's fields computed from the config alone (its sha256, its name, the seeded order, the points' entries
# (plan.point_entries; their frozen references are not compared), the detectable effect's n, alpha and power): where
# a config key differs, a refusal names the key and counts these. Every other field (code identity, checkpoint hash,
# devices, the noise source's hash...) has inputs of its own and is always named.
FOLLOWS_FROM_CONFIG = ("config_sha256", "name", "order", "points", "detectable_effect")
NOT_FROM_CONFIG_ALONE = ("detectable_effect.noise",)


def _follows_from_config(path: str) -> bool:
    return path.split(".")[0].split("[")[0] in FOLLOWS_FROM_CONFIG and not path.startswith(NOT_FROM_CONFIG_ALONE)


def _words(diffs: list[tuple[str, object, object]]) -> str:
    listed = [f"{p} (bundle {_short(a)}, this run {_short(b)})" for p, a, b in diffs[:MAX_LISTED]]
    more = f"; and {len(diffs) - MAX_LISTED} more" if len(diffs) > MAX_LISTED else ""
    return "; ".join(listed) + more


def _as_json(data):
    """``data`` as it reads back from its JSON file (tuples as lists, str subclasses such as torch's
    version as str), so that a difference is one of value, never of Python type."""
    return json.loads(json.dumps(data))


def _as_planned(spec: BenchSpec, planned: dict) -> BenchSpec:
    """This run's config with the keys that only say where bundles live (``resume``, ``results_dir``)
    taken from the bundle's: a bundle may be resumed where it lies now."""
    return dataclasses.replace(spec, resume=None, results_dir=planned.get("results_dir", spec.results_dir))


# executor keys that only bound how long a child may run or take to stop: no measurement depends on them, so a resume
# runs its sessions under its own. Held to the bundle's, a session killed at the bundle's timeout before its first
# arm (a slower or busier machine) was killed there again on every resume, and only a new run, losing every record,
# could raise it. plan.json keeps the first run's values; the resume names any it changes.
LIMITS = ("session_timeout_s", "reference_timeout_s", "stop_grace_s")
SLURM_LIMITS = ("time_limit_min",)


def _with_planned_limits(spec: BenchSpec, planned: dict) -> BenchSpec:
    """``spec`` with the bundle's :data:`LIMITS` (and :data:`SLURM_LIMITS`) from its plan's config ``planned``,
    so that they take no part in the comparison of the two plans."""
    ex = planned.get("executor") or {}
    slurm = ex.get("slurm") or {}
    return dataclasses.replace(spec, executor=dataclasses.replace(
        spec.executor, **{k: ex[k] for k in LIMITS if k in ex},
        slurm=dataclasses.replace(spec.executor.slurm, **{k: slurm[k] for k in SLURM_LIMITS if k in slurm})))


def changed_limits(spec: BenchSpec, planned: dict) -> list[str]:
    """The :data:`LIMITS` and :data:`SLURM_LIMITS` this run sets otherwise than the bundle's plan config ``planned``,
    as ``executor.KEY = this run's (the plan's ...)``."""
    theirs, ours = planned.get("executor") or {}, spec.to_plain()["executor"]
    pairs = [(f"executor.{k}", theirs.get(k), ours[k]) for k in LIMITS]
    pairs += [(f"executor.slurm.{k}", (theirs.get("slurm") or {}).get(k), ours["slurm"][k]) for k in SLURM_LIMITS]
    return [f"{key} = {new!r} (the plan's {old!r})" for key, old, new in pairs if old != new]


def _comparable_plan(plan: dict) -> dict:
    """The plan without what a resume may change: its creation time and the points' frozen references
    (the resume reuses those, after checking their hashes)."""
    out = {k: v for k, v in plan.items() if k != "created_utc"}
    out["points"] = [{k: v for k, v in pt.items() if k != "reference"} for pt in plan.get("points", [])]
    return out


def _environment_identity(env: dict) -> dict:
    """What a resumed session must share with the first: interpreter, torch, libraries, CPU model, GPUs."""
    return {"python": (env.get("python") or {}).get("version"), "torch": env.get("torch"),
            "packages": env.get("packages"), "cpu": (env.get("cpu") or {}).get("model"), "gpus": env.get("gpus")}


class ResumeRefused(ValueError):
    """A resume (or finish) refused before the bundle changed: the command line names a bundle that cannot be
    resumed as asked (``loopbench bench`` exits 2, a bad configuration or usage, naming why in one line)."""


def _claim(bundle: Path, child_wait_s: float = CHILD_EXIT_WAIT_S) -> int:
    """The bundle's exclusive lock, once no controller and no child of it runs (a child is waited for up to
    ``child_wait_s``); ValueError otherwise."""
    lock = try_lock(bundle, wait_s=0.5)   # a show or audit takes the lock for an instant (compare.unpublished_hint)
    if lock is None:
        raise ResumeRefused(f"{bundle} is held by a running controller; stop it (SIGTERM publishes the bundle) "
                         "or wait for it")
    if (bundle / "jobs").is_dir():
        jobs = try_lock(bundle / "jobs", wait_s=child_wait_s)
        if jobs is None:
            os.close(lock)
            raise ResumeRefused(f"a child of {bundle} still runs {child_wait_s:.0f} s after its controller "
                             f"ended (it holds {bundle / 'jobs'}); stop it first")
        os.close(jobs)
    return lock


def _read_children(bundle: Path) -> list[dict]:
    path = bundle / "children.json"
    return json.loads(path.read_text()) if path.is_file() else []


def _mark_lost(bundle: Path, children: list[dict]) -> list[dict]:
    """``running`` entries of a controller that died: interrupted, end unknown (a line in each log says so)."""
    out = []
    for c in children:
        if c["state"] == "running":
            with open(bundle / "logs" / c["log"], "a") as fh:
                fh.write(f"[finish] {c.get('session', c['name'])}: its controller ended without publishing; "
                         "marked interrupted\n")
            c = {**c, "state": "interrupted", "exit_code": None, "wall_s": None, "interrupted_by": "lost"}
        out.append(c)
    return out


def _bundle_json(bundle: Path, name: str):
    """The parsed JSON of ``bundle / name``; ResumeRefused naming the file when it is missing or no JSON (a damaged
    bundle is named, never a traceback)."""
    try:
        return json.loads((bundle / name).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ResumeRefused(f"{bundle / name} cannot be read ({type(exc).__name__}: {exc}): the bundle is damaged. "
                            "Nothing was changed") from None


def _published_status(bundle: Path) -> str | None:
    """The published summary's status, or None for a bundle without a manifest (in progress, or lost)."""
    if not (bundle / "manifest.json").is_file():
        return None
    try:
        return json.loads((bundle / "summary.json").read_text())["status"]
    except (OSError, ValueError, KeyError):
        return "unreadable"


def finish(bundle: Path) -> RunResult:
    """Publish the bundle of a controller that died without publishing (incomplete, no verdict: its running child is
    marked lost) or that could not write it (complete where every child had ended, as after a full disk)."""
    bundle = Path(bundle)
    if not (bundle / "plan.json").is_file():
        raise ResumeRefused(f"{bundle} has no plan.json: its controller stopped before it planned anything and "
                         "nothing was measured; delete the folder")
    lock = _claim(bundle)
    try:
        status = _published_status(bundle)
        if status is not None:
            raise ResumeRefused(f"{bundle} is published already (status {status}); there is nothing to finish")
        plan = _bundle_json(bundle, "plan.json")
        _check_same_code(bundle, plan)
        env = _bundle_json(bundle, "environment.json")
        return publish(bundle, plan, _mark_lost(bundle, _read_children(bundle)), env)
    finally:
        os.close(lock)


def _check_same_code(bundle: Path, plan: dict) -> None:
    """ResumeRefused unless this checkout's runtime, harness and kernels sources and bundle format contract hash
    as those that measured ``bundle`` (its plan's ``code.code_sha256``, identity.code_identity): the publisher
    writes the summary, report and format version of its own code, so other code would publish, under the
    measuring code's name, a bundle its auditor may fail (a format-8 bundle finished by format-9 code lacks
    engine_settings)."""
    if not isinstance(plan, dict) or not isinstance(plan.get("code", {}), dict):
        bad = f"plan.json is {plan!r}" if not isinstance(plan, dict) else f"plan.json's code is {plan['code']!r}"
        raise ResumeRefused(f"{bundle}/{bad}, not an object: it does not say which code measured it. Nothing was "
                            "changed")
    code = plan.get("code") or {}
    ours = identity.code_identity()
    if code.get("code_sha256") != ours["code_sha256"]:
        raise ResumeRefused(
            f"{bundle} was measured by other code (git {code.get('git_sha') or 'unknown'}, code_sha256 "
            f"{str(code.get('code_sha256'))[:12]}) than this checkout's (git {ours['git_sha'] or 'unknown'}, "
            f"code_sha256 {ours['code_sha256'][:12]}); a bundle is published by the code that measured it, so run "
            "finish from a checkout of that commit. Nothing was changed")


def _kept_and_todo(bundle: Path, plan: dict) -> tuple[dict[str, list[int]], list[tuple[Path, Path | None]]]:
    """Per device, the planned seqs still to measure; and the lone records (an arm without its partner, measured
    again with it), each with its server log (an online run's; None for an arm record). ValueError when the kept
    records are not a prefix of the planned order."""
    records = {}
    for path in sorted((bundle / "raw").glob("*/*.json")):
        rec = json.loads(path.read_text())
        records[(rec["job"], rec["seq"])] = path
    todo, lone = {}, []
    for dev in plan["devices"]:
        name, order = dev["name"], plan["order"][dev["name"]]
        pairs: dict[tuple, list[int]] = {}
        for item in order:
            pairs.setdefault((item["point"], item["comparison"], item["pair"]), []).append(item["seq"])
        complete = {s for seqs in pairs.values() if all((name, q) in records for q in seqs) for s in seqs}
        lone += [(records[(name, s)], None) for seqs in pairs.values() for s in seqs
                 if (name, s) in records and s not in complete]
        kept = [item["seq"] for item in order if item["seq"] in complete]
        if kept != [item["seq"] for item in order[:len(kept)]]:
            gap = next(item["seq"] for item in order if item["seq"] not in complete)
            raise ResumeRefused(f"cannot resume {bundle}: the completed pairs of {name} are not a prefix of its "
                             f"planned order (seq {gap} is missing before seq {kept[-1]}), so the rest cannot be "
                             "measured in order")
        todo[name] = [item["seq"] for item in order[len(kept):]]
    return todo, lone + _lone_online_runs(bundle, plan)


def _online_records(bundle: Path, plan: dict) -> list[tuple[dict, Path]]:
    """Each online order item of ``plan`` with the path of its raw record (none without an online track)."""
    online = plan.get("online")
    if not online:
        return []
    from .online.arms import record_stem

    return [(item, bundle / "online" / online["device"] / f"{record_stem(item)}.json") for item in online["order"]]


def _online_left(bundle: Path, plan: dict, lone: list[Path]) -> tuple[int, int]:
    """(runs of the online track, those a resume measures): every planned run whose record is not in the bundle or
    is among ``lone`` (a lone run of a pair, superseded); (0, 0) without an online track."""
    gone, paths = set(lone), [path for _, path in _online_records(bundle, plan)]
    return len(paths), sum(1 for p in paths if p in gone or not p.is_file())


def _lone_online_runs(bundle: Path, plan: dict) -> list[tuple[Path, Path]]:
    """The online track's runs whose pair's other run was not recorded (a stop between the two), each with its server
    log beside it: superseded as a lone arm is, so that the resumed session measures the pair again, its two runs
    back to back in one session."""
    pairs: dict[tuple, list[Path]] = {}
    for item, path in _online_records(bundle, plan):
        if item["kind"] == "arm":
            pairs.setdefault((item["rate_index"], item["pair"]), []).append(path)
    return [(path, path.with_suffix(".log")) for paths in pairs.values() if not all(p.is_file() for p in paths)
            for path in paths if path.is_file()]


def _checkpoint_at_hand(spec: BenchSpec, cache: Path) -> bool:
    """Whether the checkpoint can be hashed without writing: a real one, or the synthetic one already cached."""
    path = inputs.checkpoint_path(spec) or inputs.synthetic_checkpoint_path(spec, cache)
    return (path / "config.json").is_file()


def _refuse_unlike_plan(spec: BenchSpec, bundle: Path, plan: dict, got: inputs.Inputs | None,
                        synthesize: bool) -> tuple[BenchSpec, inputs.Inputs, dict, bool]:
    """This run's plan must be the bundle's: ValueError naming each difference, before anything changes.

    ``got``: this run's inputs where the caller gathered them already (``planning.check``; they do not
    depend on ``resume`` or ``results_dir``), else gathered here. ``synthesize``: write a synthetic
    checkpoint missing from the cache to compare its sha256 (a resume); without it (``loopbench plan``,
    which creates nothing) such a checkpoint is left out of the comparison.

    Returns (this run's spec with the bundle's locations, its inputs, the bundle's environment, whether
    the checkpoint was compared).
    """
    ours = _as_planned(spec, plan["config"])
    got = inputs.gather(ours) if got is None else got
    if synthesize:   # a resume writes a missing checkpoint into the cache: a cache it cannot make is named first
        make_cache(ours, got.cache, f"{spec.resume} is unchanged")
    compared = synthesize or _checkpoint_at_hand(ours, got.cache)
    fresh = make_plan(_with_planned_limits(ours, plan["config"]), got,
                      prepare_checkpoint(ours, got.cache) if compared else None, point_entries(ours))
    old, new = _comparable_plan(plan), _comparable_plan(_as_json(fresh))
    if not compared:   # a resume compares it once synthesized (seeded, but calibrated on this host's device)
        del old["checkpoint"], new["checkpoint"]
    diffs, follow = _differences(old, new), 0
    if any(d[0].startswith("config.") for d in diffs):
        # the changed config keys are named; the plan fields that follow from the config are counted, not listed
        named = [d for d in diffs if not _follows_from_config(d[0])]
        diffs, follow = named, len(diffs) - len(named)
    if (bundle / plan["prompts"]["file"]).read_text() != got.prompts_text:
        diffs.append((plan["prompts"]["file"], "its file", "this run's prompts"))
    env = _bundle_json(bundle, "environment.json")
    diffs += [(f"environment.{p}", a, b) for p, a, b in
              _differences(_environment_identity(env), _environment_identity(_as_json(machine.environment(got.devices))))]
    if diffs:
        following = f" (and in {follow} field(s) of the plan that follow from the config)" if follow else ""
        raise ResumeRefused(f"cannot resume {bundle}: this run differs from its plan in {_words(diffs)}{following}")
    for pt in plan["points"]:
        ref = pt.get("reference")
        if not ref:
            raise ResumeRefused(f"cannot resume {bundle}: point {pt['key']} has no frozen reference (the reference "
                             "capture did not finish); start a new run")
        for rel, want in ((ref["file"], ref["sha256"]), (ref["meta_file"], ref["meta_sha256"])):
            if not (bundle / rel).is_file() or sha256_file(bundle / rel) != want:
                raise ResumeRefused(f"cannot resume {bundle}: {rel} does not match the sha256 in plan.json")
    changed = evidence.unlike_manifest(bundle)
    if changed:
        raise ResumeRefused(f"cannot resume {bundle}: its files no longer match its manifest.json ({changed}); a "
                         "resume would publish them again as measured")
    return ours, got, env, compared


@dataclasses.dataclass(frozen=True)
class ResumeCheck:
    """What a resume of ``bundle`` would do, found by :func:`check_resume` with nothing changed."""

    bundle: Path
    status: str | None                  # the published summary's status; None: unpublished (its controller died)
    planned: int                        # arm runs of the plan, every device
    todo: dict[str, tuple[int, ...]]    # per device, the planned seqs a resume measures (the rest of its order)
    lone: tuple[Path, ...]              # lone arms' records (their pair's other arm unrecorded): measured again with it
    checkpoint_compared: bool           # False: a synthetic checkpoint not yet cached (plan writes none)
    online_planned: int = 0             # runs of the online track (plan.json online.order); 0 without one
    online_left: int = 0                # of those, the runs a resume measures (unrecorded, or superseded lone ones)
    limits: tuple[str, ...] = ()        # the LIMITS this run changes (changed_limits), under which its children run
    superseded: tuple[tuple[Path, Path], ...] = ()   # (file, where the resume keeps it): the lone records, server logs

    @property
    def left(self) -> int:
        return sum(len(seqs) for seqs in self.todo.values())

    @property
    def kept(self) -> int:
        return self.planned - self.left


def _bundle_of(spec: BenchSpec) -> Path:
    bundle = Path(spec.resume).expanduser()
    return (bundle if bundle.is_absolute() else Path.cwd() / bundle).resolve()


def _check(spec: BenchSpec, got: inputs.Inputs | None,
           synthesize: bool) -> tuple[ResumeCheck, BenchSpec, inputs.Inputs, dict, dict]:
    """:func:`check_resume`, with what ``resume`` goes on with: (check, this run's spec with the bundle's
    locations, its inputs, the bundle's environment, the bundle's plan)."""
    bundle = _bundle_of(spec)
    if not (bundle / "plan.json").is_file():
        raise ResumeRefused(f"resume = {spec.resume!r}: {bundle} has no plan.json, so there is no plan to resume")
    plan = _bundle_json(bundle, "plan.json")
    status = _published_status(bundle)
    if status == "complete":
        raise ResumeRefused(f"resume = {spec.resume!r}: the bundle is complete; a complete bundle cannot be "
                         "resumed (start a new run instead)")
    ours, got, env, compared = _refuse_unlike_plan(spec, bundle, plan, got, synthesize)
    todo, lone = _kept_and_todo(bundle, plan)
    online_planned, online_left = _online_left(bundle, plan, [record for record, _ in lone])
    moves = [m for record, log in lone for m in superseded.moves(bundle, record, log)]
    taken = superseded.taken(moves)
    if taken:   # the session of a lone record measured it once: only another hand puts a file there
        raise ResumeRefused(f"cannot resume {bundle}: {taken[0].relative_to(bundle)} exists already, where the "
                            "resume would keep a lone record it measures again; a superseded record is never "
                            "overwritten. Nothing was changed")
    check = ResumeCheck(bundle=bundle, status=status, planned=sum(len(v) for v in plan["order"].values()),
                        todo={name: tuple(seqs) for name, seqs in todo.items()}, lone=tuple(r for r, _ in lone),
                        checkpoint_compared=compared, online_planned=online_planned, online_left=online_left,
                        limits=tuple(changed_limits(ours, plan["config"])), superseded=tuple(moves))
    return check, ours, got, env, plan


def check_resume(spec: BenchSpec, got: inputs.Inputs | None = None) -> ResumeCheck:
    """Every check :func:`resume` makes of ``spec.resume`` before it changes anything (plan.json, not
    complete, this run's plan the bundle's, completed pairs a prefix of the order), and what it would
    then do; ResumeRefused (a ValueError) naming the first problem. Reads only: no lock held, no card claimed, and a synthetic checkpoint missing from
    the cache is not written but left out of the comparison (``checkpoint_compared``). ``got``: this
    run's inputs, if gathered already. A bundle that a controller or child holds now is refused as
    :func:`resume` refuses it (its lock is taken for an instant and let go)."""
    bundle = _bundle_of(spec)
    if bundle.is_dir():            # else _check names what is missing
        os.close(_claim(bundle, child_wait_s=0.5))
    return _check(spec, got, synthesize=False)[0]


def resume(spec: BenchSpec) -> RunResult:
    """Measure the rest of the incomplete bundle ``spec.resume`` (see the module docstring)."""
    lock, held = _claim(_bundle_of(spec)), []
    try:
        with StopSignals(before_children=True) as stop:   # no stop is lost: raised in the checks, recorded after
            # under the lock: no controller adds records while the kept ones are counted
            with unless_stopped(stop, lambda: f"interrupted while checking {spec.resume} for the resume: the bundle "
                                              "is unchanged"):
                check, ours, got, env, plan = _check(spec, None, synthesize=True)
            bundle, todo = check.bundle, check.todo
            held = cards.claim(plan["devices"])   # a card another run measures on: refused, the bundle unchanged

            # --- from here on the bundle changes (unpublished, lone arms superseded, new sessions); a stop is recorded
            # and the executor, polling it before any child starts, ends in an incomplete bundle published again
            stop.before_children = False
            children = _mark_lost(bundle, _read_children(bundle))
            current = {c["name"]: c for c in children}
            devices = [d for d in plan["devices"] if todo[d["name"]] or current.get(d["name"], {}).get("state") != "completed"]
            evidence.unpublish(bundle)
            # progress lines, on stderr like every other (README; --quiet silences them): stdout is the result's
            for src, dst in check.superseded:
                progress.say("resume", f"keeping {src.relative_to(bundle)} as {dst.relative_to(bundle)} (its pair's "
                             "other arm was not recorded; the resume measures the pair again, and this run stays out "
                             "of every figure)")
            superseded.set_aside(list(check.superseded))
            attempt = 1 + max((c.get("attempt", 0) for c in children), default=0)
            online = (f"; {check.online_left} of the online track's {check.online_planned} runs to run"
                      if check.online_planned else "")
            progress.say("resume", f"{bundle} (run {attempt}): {check.kept} of {check.planned} arms kept, "
                         f"{check.left} to measure{online}")
            for limit in check.limits:
                progress.say("resume", f"this resume's children run under {limit}; a limit changes no measurement")
            write_children(bundle, children)
            if devices:
                executor = make_executor(ours, bundle, got.cache, devices)
                children += run_restarts(ours.executor, executor, bundle, plan, devices, children, stop, attempt,
                                         {d["name"]: list(todo[d["name"]]) for d in devices})
            stop.publishing = True
            return published(publish(bundle, plan, children, env), stop)
    finally:
        os.close(lock)
        cards.release(held)
