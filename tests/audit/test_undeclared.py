"""From format version 2 every JSON document holds only the fields the contract defines: a claim smuggled in
an undeclared field (plan.json "verdict", an extra key in a record, manifest, reference...) is named."""
import json

import pytest

from tests.audit.tamper import edit_json, failed, raw, rewrite_manifest


def _reference_file(bundle, which):
    plan = json.loads((bundle / "plan.json").read_text())
    ref = next(p["reference"] for p in plan["points"] if p.get("reference"))
    return bundle / ref["file" if which == "schedule" else "meta_file"]


FORGES = {  # where -> (file of the bundle, edit, what the auditor names)
    "plan": (lambda b: b / "plan.json", lambda d: d.update(verdict="alias is 2x faster"),
             "plan: plan.json: verdict is a field that"),
    "plan point": (lambda b: b / "plan.json", lambda d: d["points"][0].update(verdict="faster"),
                   "point 'B2C3': verdict is a field that"),
    "plan request": (lambda b: b / "plan.json", lambda d: d["points"][0]["requests"][0].update(note="x"),
                     "requests: note is a field that"),
    "plan order": (lambda b: b / "plan.json", lambda d: d["order"]["cpu0"][0].update(note="x"),
                   "plan.json: order cpu0: note is a field that"),
    "record": (lambda b: raw(b, 0), lambda d: d.update(verdict="faster"), "is not an arm record: verdict is a field"),
    "record phase": (lambda b: raw(b, 0), lambda d: d["measured"].update(note="x"),
                     "is not an arm record: measured.note is a field"),
    "record device": (lambda b: raw(b, 0), lambda d: d["device"].update(note="x"),
                      "is not an arm record: device.note is a field"),
    "schedule": (lambda b: _reference_file(b, "schedule"), lambda d: d.update(note="x"), "schedule note is a field"),
    "meta": (lambda b: _reference_file(b, "meta"), lambda d: d.update(note="x"), "meta note is a field"),
    "children": (lambda b: b / "children.json", lambda d: d[0].update(note="x"), "note is a field that"),
    "environment": (lambda b: b / "environment.json", lambda d: d["python"].update(note="x"),
                    "environment.json: is not the environment document of"),
}


@pytest.mark.parametrize("where", sorted(FORGES))
def test_undeclared_field_is_named(bundle, where):
    path, forge, named = FORGES[where]
    edit_json(path(bundle), forge)
    rewrite_manifest(bundle)
    assert named in failed(bundle)


def test_undeclared_manifest_fields_are_named(bundle):
    rewrite_manifest(bundle)
    edit_json(bundle / "manifest.json", lambda m: m.update(verdict="faster"))
    assert "manifest: manifest.json: verdict is a field that" in failed(bundle)
    rewrite_manifest(bundle)
    edit_json(bundle / "manifest.json", lambda m: m["files"]["plan.json"].update(note="x"))
    assert "manifest: lists plan.json: note is a field that" in failed(bundle)
