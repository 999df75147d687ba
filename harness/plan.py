"""The frozen plan (``plan.json``): everything a measurement depends on, hashed, and the full order.

The measurement order of a device: ``sessions`` restarts one after another (each a fresh process,
harness/controller.py); within restart s, per point, the comparisons' pairs interleaved (pair 0 of
every comparison, then pair 1, ...), each pair's first arm from ``stats.balanced_first`` seeded with
(order_seed, point index, comparison index), and with the restart index appended for s > 0 (so one
session's order is the one a bundle before restarts planned). Pair indices run on over restarts:
restart s holds pairs s * pairs .. (s + 1) * pairs - 1 (``stats.restart_of``). Every device runs the
same order.

``detectable_effect``: the minimum effect the declared pairs and sessions can detect
(``stats.detectable_effect``), with the noise it assumes and where that came from.
"""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

from . import evidence, natural, stats, workloads
from .fileio import canonical_json, sha256_bytes
from .inputs import Inputs
from .online.plan import online_plan
from .records import OrderItem
from .spec import BenchSpec
from .stats import restart_of

PLAN_SCHEMA = 2   # 2: sessions (restarts) in the order, detectable_effect


def point_entries(spec: BenchSpec) -> list[dict]:
    """The plan's ``points``: {key, max_num_seqs, num_requests, prompt_len, output_len, requests}
    (``reference`` is added once captured); ``prompt_len`` is the point's own P (None: the workload's
    prompts), ``output_len`` its D; ``requests`` lists each request's id and prompt index
    (``evidence.point_requests``, at the point's block of the pool: harness/workloads.py)."""
    offsets = workloads.prompt_offsets(spec)
    return [{"key": pt.key, "max_num_seqs": pt.max_num_seqs, "num_requests": pt.num_requests,
             "prompt_len": pt.prompt_len, "output_len": workloads.output_len(spec, pt),
             "requests": evidence.point_requests(pt.num_requests, offsets[pt.prompt_len])} for pt in spec.points]


def measurement_order(spec: BenchSpec) -> list[OrderItem]:
    """Every arm run of one device, over all its restarts, in order (see the module docstring)."""
    order: list[OrderItem] = []
    comps, n = spec.comparisons, spec.pairs
    for restart in range(spec.sessions):
        for pi, pt in enumerate(spec.points):
            firsts = [stats.balanced_first(n, [spec.order_seed, pi, ci] + ([restart] if restart else []))
                      for ci in range(len(comps))]
            for i in range(n):
                for ci, comp in enumerate(comps):
                    positions = ("baseline", "candidate") if firsts[ci][i] == "baseline" else ("candidate", "baseline")
                    for slot, pos in enumerate(positions):
                        order.append(OrderItem(seq=len(order), point=pt.key, comparison=comp.name,
                                               pair=restart * n + i, position=pos, slot=slot, arm=getattr(comp, pos)))
    return order


def restart_seqs(order: list[dict], pairs_per_session: int, sessions: int) -> list[list[int]]:
    """The seqs of each restart of a device's planned ``order`` (plan.json items), restart by restart."""
    out: list[list[int]] = [[] for _ in range(sessions)]
    for item in order:
        out[restart_of(item["pair"], pairs_per_session)].append(item["seq"])
    return out


NOISE_BUNDLE, NOISE_DECLARED, NOISE_UNKNOWN = "bundle", "declared", "unknown"
MDE_METHOD = "normal approximation, paired: (z_{1-alpha/2} + z_power) * sigma / sqrt(n) on log pair ratios"


def aa_ratios(bundle: Path) -> list[float]:
    """Every A/A pair ratio (a comparison whose baseline is its candidate) of a bundle's ``summary.json``,
    in its results' order; ValueError when it has none (it then says nothing about noise)."""
    summary = json.loads((Path(bundle).expanduser() / "summary.json").read_text())
    ratios = [float(r) for res in summary["results"] if res["baseline"] == res["candidate"]
              for r in res["stats"]["ratios"]]
    if len(ratios) < 2:
        raise ValueError(f"evidence.noise_bundle = {str(bundle)!r} has {len(ratios)} A/A pair ratios; the noise "
                         "estimate needs at least 2")
    return ratios


def detectable_effect(spec: BenchSpec) -> dict:
    """The plan's ``detectable_effect``: n = pairs * sessions per (device, point, comparison), alpha =
    1 - verdict.confidence, the declared power, and sigma (SD of one pair's log ratio) from
    ``evidence.noise_bundle``'s A/A ratios (kept here, with the summary's sha256, so the auditor
    recomputes sigma), else ``evidence.noise_sigma``, else unknown (no MDE)."""
    ev = spec.evidence
    noise = {"source": NOISE_UNKNOWN, "bundle": None, "summary_sha256": None, "ratios": None, "sigma_log_ratio": None}
    if ev.noise_bundle is not None:
        ratios = aa_ratios(Path(ev.noise_bundle))
        noise = {"source": NOISE_BUNDLE, "bundle": str(ev.noise_bundle),
                 "summary_sha256": sha256_bytes((Path(ev.noise_bundle).expanduser() / "summary.json").read_bytes()),
                 "ratios": ratios, "sigma_log_ratio": stats.log_ratio_sd(ratios)}
    elif ev.noise_sigma is not None:
        noise = {**noise, "source": NOISE_DECLARED, "sigma_log_ratio": float(ev.noise_sigma)}
    alpha = 1 - spec.verdict.confidence
    mde = stats.detectable_effect(noise["sigma_log_ratio"], spec.pairs * spec.sessions, alpha, ev.power)
    return {"method": MDE_METHOD, "alpha": alpha, "power": ev.power, "pairs_per_session": spec.pairs,
            "sessions": spec.sessions, **mde, "noise": noise}


def make_plan(spec: BenchSpec, got: Inputs, ckpt: dict, points: list[dict]) -> dict:
    """``plan.json``: config and its sha256, code, checkpoint, prompts, points (with their frozen
    references where captured), devices and every device's measurement order."""
    config = spec.to_plain()
    order = [item.to_dict() for item in measurement_order(spec)]
    return {
        "schema_version": PLAN_SCHEMA, "name": spec.name,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": config, "config_sha256": sha256_bytes(canonical_json(config).encode()),
        "code": got.code, "checkpoint": ckpt,
        "prompts": {"file": "prompts.json", "sha256": got.prompts_sha256,
                    "count": len(got.prompts), "lengths": sorted({len(p) for p in got.prompts})},
        "max_model_len": got.max_model_len, "points": points, "reference_arm": spec.reference,
        "devices": got.devices, "order": {d["name"]: order for d in got.devices},
        "detectable_effect": detectable_effect(spec),
        **({"online": online_plan(spec, got.devices)} if spec.online is not None else {}),
        "natural": natural.plan_entry(config, [pt["key"] for pt in points]),
    }
