"""What each child was asked to do: ``jobs/<kind>-<stem>.json`` (``documents.job``), held to the plan.

The controller writes a child's job file before the child starts, from the same frozen inputs as plan.json, and
the reference child keys each frozen reference it writes by its job's ``key_material`` (with the point, its
device's name and its torch: the meta's ``cache_key``). Held here, in every format version:

- each job file has the contract's fields (closed from ``documents.closed_since``); its kind and name are those of
  its file name, its device the plan's device of that name, a session job's ``session`` the id in its file name and
  its ``seqs`` seqs of its device's order;
- the reference job's spec and key material are the plan's: the reference arm and its config, the exit rule, the
  dtype, the workload and points, the prompts, the checkpoint and the code's sha256;
- each frozen reference's meta ``cache_key`` is the hash of that key material (``documents.job.cache_key``): the
  code and checkpoint plan.json names are those the reference child was keyed by, so a plan that names other code
  disagrees with a file the child wrote.
"""
from __future__ import annotations

import hashlib

from . import contract
from .context import Audit
from .values import canonical, field_diffs

JOB = contract.DOCS["job"]
KINDS = ("reference", "session")


def _fields_problem(job: dict, closed: bool) -> str | None:
    problem = contract.fields_problem(job, JOB["fields"], "", JOB["optional"], closed) \
        or contract.fields_problem(job["device"], JOB["device_fields"], "device.", JOB["device_optional"], closed)
    if problem is None and job["kind"] == "reference":
        spec = job.get("spec")
        problem = "spec is missing" if spec is None else \
            contract.fields_problem(spec, JOB["spec_fields"], "spec.", JOB["spec_optional"], closed) \
            or contract.fields_problem(spec["key_material"], JOB["key_material_fields"], "spec.key_material.",
                                       JOB["key_material_optional"], closed)
    elif problem is None and "spec" in job:
        problem = "spec is in a session job"
    if problem is None and "seqs" in job and not all(contract.is_kind(s, "int") for s in job["seqs"]):
        problem = f"seqs is {job['seqs']!r}"
    return problem


def _planned_device(dev: dict) -> dict:
    """The job's ``device`` entry the controller writes for a device of the plan."""
    return {"kind": dev["kind"], "gpu_index": dev["gpu_index"], "cpu_threads": dev["cpu_threads"],
            **({"cpu_index": dev["cpu_index"]} if "cpu_index" in dev else {})}


def planned_spec(plan: dict, spec: dict) -> dict:
    """What the plan says the reference job's spec holds (its optional fields where the job has them) and where
    the plan says it, as ``{field: (value, where)}``."""
    cfg, ref = plan["config"], plan["reference_arm"]
    code = plan["code"]
    engine = cfg["arms"][ref].get("engine")
    want = {
        "spec.arm": (ref, "plan.json reference_arm"),
        "spec.arm_config": (cfg["arms"][ref], f"plan.json config.arms.{ref}"),
        "spec.exit": (cfg["exit"], "plan.json config.exit"),
        "spec.dtype": (cfg["model"]["dtype"], "plan.json config.model.dtype"),
        "spec.max_model_len": (plan["max_model_len"], "plan.json max_model_len"),
        "spec.output_len": (cfg["workload"]["output_len"], "plan.json config.workload.output_len"),
        "spec.prompts_file": (plan["prompts"]["file"], "plan.json prompts.file"),
        "spec.reuse": (cfg.get("reuse_references", True), "plan.json config.reuse_references"),
        "spec.checkpoint_path": (plan["checkpoint"]["path"], "plan.json checkpoint.path"),
        "spec.points": ([{k: v for k, v in pt.items() if k != "reference"} for pt in plan["points"]],
                        "plan.json points"),
        "spec.key_material.arm": (cfg["arms"][ref], f"plan.json config.arms.{ref}"),
        "spec.key_material.checkpoint_sha256": (plan["checkpoint"]["sha256"], "plan.json checkpoint.sha256"),
        "spec.key_material.code_sha256": (code["code_sha256"], "plan.json code.code_sha256"),
        "spec.key_material.dtype": (cfg["model"]["dtype"], "plan.json config.model.dtype"),
        "spec.key_material.exit": (cfg["exit"], "plan.json config.exit"),
        "spec.key_material.prompts_sha256": (plan["prompts"]["sha256"], "plan.json prompts.sha256"),
        "spec.key_material.workload": (cfg["workload"], "plan.json config.workload"),
    }
    optional = {"spec.arms": (cfg["arms"], "plan.json config.arms"),
                "spec.warmup": (cfg.get("warmup"), "plan.json config.warmup"),
                "spec.engine_sources": (code.get("engine_sources", {}), "plan.json code.engine_sources"),
                "spec.key_material.engine_source_sha256": (code.get("engine_sources", {}).get(engine),
                                                           f"plan.json code.engine_sources.{engine}")}
    has = {f"spec.{k}" for k in spec} | {f"spec.key_material.{k}" for k in spec["key_material"]}
    return {**want, **{k: v for k, v in optional.items() if k in has}}


def _check_reference_spec(ctx: Audit, rel: str, plan: dict, spec: dict) -> None:
    got = {**{f"spec.{k}": v for k, v in spec.items()},
           **{f"spec.key_material.{k}": v for k, v in spec["key_material"].items()}}
    want = planned_spec(plan, spec)
    if len(spec["points"]) == len(want["spec.points"][0]) and all(isinstance(pt, dict) for pt in spec["points"]):
        # the fields a plan point of this format holds (a version-1 plan point lists no requests, its job's did)
        got["spec.points"] = [{k: pt.get(k) for k in mine} for pt, mine in zip(spec["points"], want["spec.points"][0])]
    for field, (value, where) in want.items():
        diffs = field_diffs(got[field], value, field)
        if diffs:
            path, mine, theirs = diffs[0]
            ctx.fail("jobs", f"{rel}: {path} is {mine!r}, where {where} gives {theirs!r}")


def _check_cache_keys(ctx: Audit, rel: str, plan: dict, spec: dict) -> None:
    """Each frozen reference's meta ``cache_key`` against the job's key material (``documents.job.cache_key``)."""
    points = {pt["key"]: pt for pt in spec["points"] if isinstance(pt, dict)}
    for pt in plan["points"]:
        meta_file = (pt.get("reference") or {}).get("meta_file")
        meta = ctx.read_json(meta_file, "reference") if isinstance(meta_file, str) else None
        if not (isinstance(meta, dict) and isinstance(meta.get("cache_key"), str)
                and isinstance(meta.get("device"), dict) and pt["key"] in points):
            continue
        material = {**spec["key_material"], "point": points[pt["key"]], "device_name": meta["device"].get("name"),
                    "torch": meta.get("torch")}
        key = hashlib.sha256(canonical(material)).hexdigest()
        if key != meta["cache_key"]:
            ctx.fail("jobs", f"{meta_file}: cache_key is {meta['cache_key']}, where {rel}'s key material (with point "
                             f"{pt['key']}, the meta's device name and torch) hashes to {key}: the reference was "
                             "captured for other code, checkpoint, prompts, workload, exit rule or arm")
        ctx.count("reference_cache_keys")


def check(ctx: Audit, plan: dict) -> None:
    """Every job file against the plan (see the module docstring)."""
    devices = {d["name"]: d for d in plan["devices"]}
    closed = ctx.version >= contract.CLOSED_SINCE
    for path in sorted((ctx.bundle / "jobs").glob("*.json")):
        rel = path.relative_to(ctx.bundle).as_posix()
        kind, _, stem = path.stem.partition("-")
        job = ctx.read_json(rel, "jobs")
        if job is None:
            continue
        problem = _fields_problem(job, closed) if isinstance(job, dict) else f"a JSON {type(job).__name__}"
        if problem is not None:
            ctx.fail("jobs", f"{rel} is not the job document of {contract.WHERE}: {problem}")
            continue
        dev = devices.get(job["name"])
        session = job.get("session", job["name"])
        if kind not in KINDS or job["kind"] != kind or (session if kind == "session" else job["name"]) != stem:
            ctx.fail("jobs", f"{rel} is a {job['kind']!r} job of {job['name']!r} (session {session!r})")
        if dev is None:
            ctx.fail("jobs", f"{rel}: name {job['name']!r} is not a device of the plan")
            continue
        diffs = field_diffs(job["device"], _planned_device(dev), "device")
        if diffs:
            ctx.fail("jobs", f"{rel}: {diffs[0][0]} is {diffs[0][1]!r}, where plan.json devices entry {dev['name']} "
                             f"gives {diffs[0][2]!r}")
        order = {it.get("seq") for it in plan["order"].get(dev["name"], []) if isinstance(it, dict)}
        stray = sorted(set(job.get("seqs", [])) - order)
        if stray:
            ctx.fail("jobs", f"{rel}: seqs {stray} are not in plan.json's order of {dev['name']}")
        if job["kind"] == "reference":
            _check_reference_spec(ctx, rel, plan, job["spec"])
            _check_cache_keys(ctx, rel, plan, job["spec"])
        ctx.count("jobs")
