"""Checks of who measured what: children ran on the plan's devices and ended; each record names a
session child of its job on its planned device; a pair is measured by one session; a job's sessions
follow each other in its order; a completed session measured exactly the seqs its job file asked for."""
from __future__ import annotations

from . import contract, derive
from .context import Audit

CHILDREN = contract.DOCS["children"]


def check_devices(ctx: Audit, plan: dict, records: list[dict], children: list[dict]) -> None:
    """Children run on the plan's devices; each record was measured on its session's planned device."""
    devices = {d["name"]: d for d in plan["devices"]}
    first = plan["devices"][0]["label"] if plan["devices"] else None
    for c in children:
        label = first if c["name"] == "reference" else devices.get(c["name"], {}).get("label")
        if label is None:
            ctx.fail("devices", f"children.json lists child {c['name']!r}, which the plan does not run")
        elif c["device"] != label:
            ctx.fail("devices", f"children.json: child {c['name']} ran on {c['device']!r}, the plan says {label!r}")
        if c.get("log") != f"{derive.child_session(c)}.log":
            ctx.fail("devices", f"children.json: child {c['name']} logs to {c.get('log')!r}, not "
                                f"{derive.child_session(c)}.log")
    child = {c["name"] for c in children}
    session_device: dict[str, dict] = {}
    for r in records:
        where, dev, d = f"record {r['job']} seq {r['seq']}", r["device"], devices.get(r["job"])
        if d is None:
            ctx.fail("devices", f"{where}: job {r['job']!r} is not a device of the plan")
            continue
        if r["job"] not in child:
            ctx.fail("devices", f"{where}: written by {r['job']}, which children.json does not list")
        # A Slurm GPU job learns its GPU only when it starts; every other session is pinned by the plan.
        pinned = not (d["kind"] == "cuda" and d["gpu_index"] is None)
        got = (dev.get("kind"), dev.get("label"), dev.get("gpu_index")) if pinned else (dev.get("kind"),)
        want = (d["kind"], d["label"], d["gpu_index"]) if pinned else (d["kind"],)
        if got != want:
            ctx.fail("devices", f"{where}: device (kind, label, gpu_index) {got} is not the plan's {want} "
                                f"for {r['job']}")
        if session_device.setdefault(r["job"], dev) != dev:
            ctx.fail("devices", f"{where}: device {dev} differs from the session's earlier arms")
    _one_card_per_device(ctx, devices, session_device)


def _one_card_per_device(ctx: Audit, devices: dict[str, dict], session_device: dict[str, dict]) -> None:
    """Two pinned devices of the plan never report one card (``device.uuid``): two sessions on one card
    time each other. A Slurm GPU job, which learns its card when it starts, may get a card another had."""
    owner: dict[str, str] = {}
    for job, dev in sorted(session_device.items()):
        d = devices[job]
        if dev.get("uuid") is None or (d["kind"] == "cuda" and d["gpu_index"] is None):
            continue
        if owner.setdefault(dev["uuid"], job) != job:
            ctx.fail("devices", f"records of {owner[dev['uuid']]} and {job} name one card {dev['uuid']!r}: two "
                                "planned devices measured on one")


def check_child_states(ctx: Audit, children: list[dict]) -> None:
    """A published bundle's children all ended (``finish`` resolves the ``running`` ones of a lost
    controller); an ``interrupted`` child names what interrupted it, and only such a child does."""
    ended = tuple(CHILDREN["ended_states"])
    for c in children:
        where = f"children.json: {derive.child_session(c)}"
        problem = contract.fields_problem(c, CHILDREN["entry_fields"], "", CHILDREN["entry_optional"],
                                          ctx.version >= contract.CLOSED_SINCE)
        if problem is not None:
            ctx.fail("sessions", f"{where}: {problem}")
        if c.get("state") not in ended:
            ctx.fail("sessions", f"{where} is {c.get('state')!r}, not an ended state {ended}")
        elif (c["state"] == "interrupted") != bool(c.get("interrupted_by")):
            ctx.fail("sessions", f"{where} is {c['state']} with interrupted_by {c.get('interrupted_by')!r}")
        if c.get("interrupted_by") is not None and c["interrupted_by"] not in CHILDREN["interrupted_by_values"]:
            ctx.fail("sessions", f"{where} has interrupted_by {c['interrupted_by']!r}, not one of "
                                 f"{CHILDREN['interrupted_by_values']} ({contract.WHERE})")


def check_slurm_jobs(ctx: Audit, plan: dict, children: list[dict]) -> None:
    """A run on a SLURM cluster records each submitted child's job (``children.slurm_fields``), and an
    ended job's SLURM state gives the child's state (``children.slurm_job_states``) unless the controller
    stopped it. A child never submitted (stopped first: interrupted, no wall time) has no job."""
    slurm_conf = plan.get("config", {}).get("executor", {})
    on_slurm = slurm_conf.get("kind") == "slurm" and slurm_conf.get("slurm", {}).get("cluster") in (None, "slurm")
    for c in children:
        where, job = f"children.json: {derive.child_session(c)}", c.get("slurm")
        if job is None:
            if on_slurm and not (c.get("state") == "interrupted" and c.get("wall_s") is None):
                ctx.fail("sessions", f"{where} ran on SLURM but records no slurm job ({contract.WHERE})")
            continue
        problem = contract.fields_problem(job, CHILDREN["slurm_fields"], "slurm.", closed=True)
        if problem is not None:
            ctx.fail("sessions", f"{where}: {problem}")
            continue
        if any(not (isinstance(v, str) and k.startswith("SLURM")) for k, v in (job["environment"] or {}).items()):
            ctx.fail("sessions", f"{where}: slurm.environment holds a variable that is not a SLURM* string")
        want = CHILDREN["slurm_job_states"].get(job["job_state"] or "")
        if want is not None and c.get("interrupted_by") is None and c.get("state") != want:
            ctx.fail("sessions", f"{where} is {c.get('state')!r}, but its SLURM job {job['job_id']} ended "
                                 f"{job['job_state']}, which is {want!r} ({contract.WHERE})")


def _sessions_by_id(ctx: Audit, children: list[dict]) -> dict[str, dict]:
    sessions: dict[str, dict] = {}
    for c in children:
        sid = derive.child_session(c)
        if sid in sessions:
            ctx.fail("sessions", f"children.json lists session {sid} twice")
        sessions[sid] = c
    return sessions


def check_sessions(ctx: Audit, plan: dict, records: list[dict], children: list[dict]) -> None:
    """Which session measured which pair (see the module docstring)."""
    sessions = _sessions_by_id(ctx, children)
    measured: dict[str, list[int]] = {}
    pair_sessions: dict[tuple, set] = {}
    last: dict[str, tuple[int, str, int]] = {}
    for r in records:
        sid, where = derive.record_session(r), f"record {r['job']} seq {r['seq']}"
        c = sessions.get(sid)
        if c is None or c["name"] != r["job"]:
            ctx.fail("sessions", f"{where}: session {sid!r} is not a session of {r['job']} in children.json")
            continue
        measured.setdefault(sid, []).append(r["seq"])
        pair_sessions.setdefault((r["job"], r["point"], r["comparison"], r["pair"]), set()).add(sid)
        attempt, prev = c.get("attempt", 0), last.get(r["job"])
        if prev is not None and attempt < prev[0]:
            ctx.fail("sessions", f"{where} by {sid} (run {attempt}) follows seq {prev[2]} by {prev[1]} "
                                 f"(run {prev[0]})")
        last[r["job"]] = (attempt, sid, r["seq"])
    for (job, point, comp, pair), sids in sorted(pair_sessions.items()):
        if len(sids) > 1:
            ctx.fail("sessions", f"{job} {point} {comp} pair {pair} was measured by sessions {sorted(sids)}")
    _check_asked_seqs(ctx, plan, sessions, measured)
    ctx.count("sessions", len(sessions))


def _check_asked_seqs(ctx: Audit, plan: dict, sessions: dict[str, dict], measured: dict[str, list[int]]) -> None:
    """A completed session measured exactly the seqs its job file asked for (all of its order without a list)."""
    devices = {d["name"] for d in plan["devices"]}
    for sid, c in sessions.items():
        if c["name"] not in devices or c.get("state") != "completed":
            continue
        asked = asked_seqs(ctx, plan, sid, c["name"])
        if asked is not None and sorted(measured.get(sid, [])) != sorted(asked):
            ctx.fail("sessions", f"{sid} completed, but measured seqs {sorted(measured.get(sid, []))}, its job "
                                 f"asked for {sorted(asked)}")


def asked_seqs(ctx: Audit, plan: dict, sid: str, device: str) -> list[int] | None:
    """The seqs session ``sid`` of ``device`` was asked to measure: its job file's ``seqs``, or all of the device's
    order where it lists none; None where the job file is missing or no object (the required-files check names it)."""
    job = ctx.read_json(f"jobs/session-{sid}.json", "sessions")
    if not isinstance(job, dict):
        return None
    asked = job.get("seqs")
    return [it["seq"] for it in plan["order"].get(device, [])] if asked is None else asked


def check_environment_gpus(ctx: Audit, plan: dict, records: list[dict], environment) -> None:
    """environment.json describes the cards the records ran on: the controller reads ``gpus`` (NVML) for every
    device the plan pins to a physical index, and a session on such a device runs on that card (the child
    refuses a CUDA card other than NVML's of its index). So the entry of a pinned record's ``gpu_index`` names
    the record's card: its ``uuid`` and ``name`` are the record's ``device.uuid`` and ``device.name`` (where
    both sides have them; an entry is null without NVML). A Slurm GPU job, which learns its card on a node the
    controller did not read, is not held."""
    if not isinstance(environment, dict) or not isinstance(environment.get("gpus"), list):
        return   # named by the environment's field check
    gpus = {g.get("index"): g for g in environment["gpus"] if isinstance(g, dict)}
    devices, seen = {d["name"]: d for d in plan["devices"]}, set()
    for r in records:   # a job's first record: check_devices holds its later ones to the same device
        d, dev = devices.get(r["job"]), r.get("device")
        if d is None or d["kind"] != "cuda" or d["gpu_index"] is None or not isinstance(dev, dict) or r["job"] in seen:
            continue
        seen.add(r["job"])
        entry = gpus.get(dev.get("gpu_index"))
        if entry is None:
            continue
        for field in ("uuid", "name"):
            if entry.get(field) is not None and dev.get(field) is not None and entry[field] != dev[field]:
                ctx.fail("environment.json", f"gpus entry of index {dev['gpu_index']} has {field} {entry[field]!r}, "
                                             f"where record {r['job']} seq {r['seq']} ran on {dev[field]!r}")
        ctx.count("environment_gpus")


def check_environment_torch(ctx: Audit, plan: dict, environment) -> None:
    """environment.json's torch is the one the reference child ran: the controller and its local children share one
    interpreter, and each frozen reference's meta records the child's ``torch`` (a reused one's is equal, since
    the torch version keys the reuse). ``packages.torch``, the distribution's version, is that version with or
    without its local part. A run on SLURM, whose children run on nodes the controller did not read, is not held."""
    if not isinstance(environment, dict) or not isinstance(environment.get("torch"), dict):
        return   # named by the environment's field check
    version = environment["torch"].get("version")
    package = (environment.get("packages") or {}).get("torch")
    if package is not None and package not in (version, str(version).split("+")[0]):
        ctx.fail("environment.json", f"packages.torch is {package!r}, torch.version {version!r}")
    if (plan.get("config") or {}).get("executor", {}).get("kind") == "slurm":
        return
    for pt in plan["points"]:
        rel = (pt.get("reference") or {}).get("meta_file")
        meta = ctx.read_json(rel, "reference") if isinstance(rel, str) else None
        if not (isinstance(meta, dict) and isinstance(meta.get("torch"), str)):
            continue
        if meta["torch"] != version:
            ctx.fail("environment.json", f"torch.version is {version!r}, where {rel} records that the reference "
                                         f"child ran torch {meta['torch']!r}")
        ctx.count("environment_torch")


ENVIRONMENT = contract.DOCS["environment"]
CPU_LOAD_SINCE = ENVIRONMENT["fields_since"]["cpu_load"]


def cpu_load_kind(load: dict) -> str | None:
    """The warning environment.json's ``cpu_load`` calls for, by the contract's ``cpu_load_rule`` (its text and
    ``busy_allowance_cores``), implemented here from that text: oversubscribed, busy, loaded or None."""
    cores, threads, busy, load_1m = load["usable_cores"], load["threads"], load["busy_cores"], load["load_average_1m"]
    if threads > cores:
        return "oversubscribed"
    if busy is None:
        return "loaded" if load_1m is not None and load_1m > cores else None
    idle_needed = min(threads, cores)
    return "busy" if busy > cores - idle_needed + ENVIRONMENT["cpu_load_rule"]["busy_allowance_cores"] else None


def check_cpu_load(ctx: Audit, plan: dict, environment) -> None:
    """From format 15, environment.json's ``cpu_load`` is there exactly when a session of the plan runs on a CPU (a
    GPU session's timings are the GPU's), counts the threads of every CPU session of the plan, and is a sample the
    machine could give: at least one usable core, busy cores between 0 and the usable ones (a small rounding
    allowance), a window over 0 and the contract's moment. The figures themselves are the machine's (nothing
    else in the bundle re-derives them); the warning report.md shows is re-derived from them (render)."""
    if ctx.version < CPU_LOAD_SINCE or not isinstance(environment, dict) or "cpu_load" not in environment:
        return   # named by the environment's field check
    load, cpus = environment["cpu_load"], [d for d in plan["devices"] if d["kind"] == "cpu"]
    if not cpus:
        if load is not None:
            ctx.fail("environment.json", f"cpu_load is {load!r}, where no session of the plan runs on a CPU (null)")
        return
    if not isinstance(load, dict):
        ctx.fail("environment.json", f"cpu_load is null, where the plan's sessions {[d['name'] for d in cpus]} run "
                                     "on a CPU")
        return
    if contract.fields_problem(load, ENVIRONMENT["cpu_load_fields"], "cpu_load.") is not None:
        return   # named by the environment's field check
    threads = sum(d.get("cpu_threads", 1) for d in cpus)
    problems = []
    if load["threads"] != threads:
        problems.append(f"threads {load['threads']!r}, where the plan's CPU sessions run {threads}")
    if load["usable_cores"] < 1:
        problems.append(f"usable_cores {load['usable_cores']!r} below 1")
    if load["busy_cores"] is not None and not -0.01 <= load["busy_cores"] <= load["usable_cores"] + 0.01:
        problems.append(f"busy_cores {load['busy_cores']!r} outside 0 .. usable_cores {load['usable_cores']}")
    if load["load_average_1m"] is not None and load["load_average_1m"] < 0:
        problems.append(f"load_average_1m {load['load_average_1m']!r} below 0")
    if load["window_s"] <= 0:
        problems.append(f"window_s {load['window_s']!r} not above 0")
    if load["sampled"] not in ENVIRONMENT["cpu_load_sampled"]:
        problems.append(f"sampled {load['sampled']!r}, not one of {ENVIRONMENT['cpu_load_sampled']}")
    for problem in problems:
        ctx.fail("environment.json", f"cpu_load has {problem}")
    ctx.count("cpu_load")
