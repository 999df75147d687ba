"""The frozen plan (``plan.json``): everything a measurement depends on, hashed, and the full order.

The measurement order: per point, the comparisons' pairs interleaved (pair 0 of every comparison,
then pair 1, ...), each pair's first arm from ``stats.balanced_first`` seeded with
(order_seed, point index, comparison index); every session runs the same order.
"""
from __future__ import annotations

import datetime as _dt

from . import evidence, stats
from .fileio import canonical_json, sha256_bytes
from .inputs import Inputs
from .records import OrderItem
from .spec import BenchSpec

PLAN_SCHEMA = 1


def point_entries(spec: BenchSpec) -> list[dict]:
    """The plan's ``points``: {key, max_num_seqs, num_requests, requests} (``reference`` is added once
    captured); ``requests`` lists each request's id and prompt index (``evidence.point_requests``)."""
    return [{"key": pt.key, "max_num_seqs": pt.max_num_seqs, "num_requests": pt.num_requests,
             "requests": evidence.point_requests(pt.num_requests)} for pt in spec.points]


def measurement_order(spec: BenchSpec) -> list[OrderItem]:
    """Every arm run of one session, in order (see the module docstring)."""
    order: list[OrderItem] = []
    comps = spec.comparisons
    for pi, pt in enumerate(spec.points):
        firsts = [stats.balanced_first(spec.pairs, [spec.order_seed, pi, ci]) for ci in range(len(comps))]
        for pair in range(spec.pairs):
            for ci, comp in enumerate(comps):
                positions = ("baseline", "candidate") if firsts[ci][pair] == "baseline" else ("candidate", "baseline")
                for slot, pos in enumerate(positions):
                    order.append(OrderItem(seq=len(order), point=pt.key, comparison=comp.name, pair=pair,
                                           position=pos, slot=slot, arm=getattr(comp, pos)))
    return order


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
    }
