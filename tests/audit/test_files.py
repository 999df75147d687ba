"""Required files, unreadable files, dotfiles, stray files and the manifest's format version."""
import json
import shutil

import pytest

from loopbench.audit import contract
from loopbench.audit.__main__ import main as audit_main
from loopbench.audit.auditor import audit
from loopbench.harness import evidence
from tests.audit.tamper import REPO, edit_json, failed, raw, rewrite_manifest


@pytest.mark.parametrize("rel", [
    "environment.json", "logs/cpu0.log", "logs/reference.log", "jobs/session-cpu0.json", "jobs/reference-cpu0.json",
    "children.json", "report.md", "pair_ratios.png", "references/B2C3.schedule.json", "references/B2C3.meta.json",
    "prompts.json", "summary.json", "plan.json", "tables/telemetry.parquet", "manifest.json"])
def test_missing_required_file_is_named(bundle, rel):
    (bundle / rel).unlink()
    if rel != "manifest.json":
        rewrite_manifest(bundle)
    text = failed(bundle)
    assert f"files: required file {rel} is missing" in text, text


def test_deleted_raw_record_makes_the_claims_wrong(bundle):
    raw(bundle, 7).unlink()
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "summary.json: status is 'complete', the audit derives 'incomplete'" in text
    assert "summary.json: counts.arms_recorded is 8, the audit derives 7" in text


def test_record_device_must_be_the_planned_device(bundle):
    edit_json(raw(bundle, 3), lambda rec: rec["device"].update(label="H200 #0", gpu_index=0))
    edit_json(bundle / "children.json", lambda ch: ch[1].update(device="H200 #1"))
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert ("devices: record cpu0 seq 3: device (kind, label, gpu_index) ('cpu', 'H200 #0', 0) is not the plan's "
            "('cpu', 'cpu', None)") in text
    assert "devices: children.json: child cpu0 ran on 'H200 #1', the plan says 'cpu'" in text
    assert "summary.json: children[1].device is 'cpu', the audit derives 'H200 #1'" in text


# ------------------------------------------------------------------ defect 7: load errors, dotfiles

def _truncate(rel):
    def edit(bundle):
        p = bundle / rel if rel != "raw" else raw(bundle, 3)
        p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
        return p.relative_to(bundle).as_posix()
    return edit


def _write(rel, text):
    def edit(bundle):
        (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
        (bundle / rel).write_text(text)
        return rel
    return edit


def _copy_record_to(rel):
    def edit(bundle):
        shutil.copy(raw(bundle, 3), bundle / rel)
        return rel
    return edit


def _drop_measured(bundle):
    path = raw(bundle, 4)
    edit_json(path, lambda rec: rec.pop("measured"))
    return path.relative_to(bundle).as_posix()


LOAD_ERRORS = {
    "truncated raw record": (_truncate("raw"), "raw: {rel} could not be read: JSONDecodeError"),
    "stray dotfile record": (_write("raw/cpu0/.x.json", "{"), "raw: {rel} could not be read: JSONDecodeError"),
    "dotfile copy of a record": (_copy_record_to("raw/cpu0/.x.json"), "raw: {rel} holds cpu0 seq 3, whose file is"),
    "record that is a list": (_write("raw/cpu0/00099-x.json", "[]"), "raw: {rel} is not an arm record: a JSON list"),
    "record without a measured run": (_drop_measured, "raw: {rel} is not an arm record: measured is missing"),
    "file outside raw/<job>/": (_write("raw/stray.json", "{}"), "raw: {rel} is not a raw/<job>/<arm>.json record"),
    "unreadable table": (_write("tables/arms.parquet", "not parquet"), "tables: {rel} could not be read"),
    "truncated summary": (_truncate("summary.json"), "files: {rel} could not be read: JSONDecodeError"),
    "truncated plan": (_truncate("plan.json"), "files: {rel} could not be read: JSONDecodeError"),
    "truncated children": (_truncate("children.json"), "files: {rel} could not be read: JSONDecodeError"),
    "truncated reference": (_truncate("references/B2C3.schedule.json"), "reference: {rel} could not be read"),
    "truncated manifest": (_truncate("manifest.json"), "files: {rel} could not be read: JSONDecodeError"),
}


@pytest.mark.parametrize("case", sorted(LOAD_ERRORS))
def test_unreadable_file_is_a_named_discrepancy_with_a_written_verdict(bundle, case, capsys):
    edit, expected = LOAD_ERRORS[case]
    rel = edit(bundle)
    if rel != "manifest.json":
        rewrite_manifest(bundle)
    assert audit_main([str(bundle)]) == 1
    verdict = json.loads((bundle / "audit.json").read_text())
    assert verdict["status"] == "fail"
    assert any(expected.format(rel=rel) in d for d in verdict["discrepancies"]), verdict["discrepancies"]
    assert "audit FAIL" in capsys.readouterr().out


def test_file_missing_from_the_manifest_is_named_dotfiles_included(bundle):
    (bundle / "raw" / "cpu0" / ".x.json").write_text("{")
    (bundle / ".notes").write_text("hello")
    evidence.write_manifest(bundle)   # the harness's manifest leaves dotfiles out; the auditor counts them
    text = failed(bundle)
    assert "manifest: raw/cpu0/.x.json is in the bundle but not in the manifest" in text
    assert "manifest: .notes is in the bundle but not in the manifest" in text
    assert "raw: raw/cpu0/.x.json could not be read" in text


# --------------------------------------------------------------------- the format contract's layout

def _copy(src: str, dest: str):
    def edit(bundle):
        (bundle / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(bundle / src, bundle / dest)
        return dest
    return edit


STRAYS = {
    "an extra table": _copy("tables/arms.parquet", "tables/arms_best.parquet"),
    "a second report": _write("report-draft.md", "# loopbench: mini (complete)\n| cpu | 2 / 3 | faster |\n"),
    "a reference of no planned point": _copy("references/B2C3.schedule.json", "references/B9C9.schedule.json"),
    "a log of no planned session": _copy("logs/cpu0.log", "logs/gpu7.log"),
    "a file in a folder the layout lacks": _write("notes/why.txt", "trust me"),
}


@pytest.mark.parametrize("case", sorted(STRAYS))
def test_stray_file_listed_in_the_manifest_is_named(bundle, case):
    """A file outside the format contract's layout fails the audit even with a true manifest entry: only the layout
    check can catch it, since no other check reads a file the format does not define."""
    rel = STRAYS[case](bundle)
    rewrite_manifest(bundle)
    assert rel in json.loads((bundle / "manifest.json").read_text())["files"]
    verdict = audit(bundle)
    assert verdict["status"] == "fail"
    assert verdict["discrepancies"] == [f"layout: {rel} is not a file of the bundle layout "
                                        f"(loopbench/bundle_format.json version {contract.VERSION})"]


def test_manifest_of_another_format_version_is_named(bundle):
    edit_json(bundle / "manifest.json", lambda m: m.update(format_version=contract.VERSION + 1))
    assert f"layout: manifest.json records bundle format version {contract.VERSION + 1}; this auditor audits " \
           f"versions {list(contract.SUPPORTED)}" in failed(bundle)


def test_manifest_with_both_version_fields_is_named(bundle):
    edit_json(bundle / "manifest.json", lambda m: m.update(layout_version=1))
    assert f"layout: manifest.json of format version {contract.VERSION} has layout_version" in failed(bundle)


def test_the_harness_writes_the_layout_contract_and_nothing_else(honest_bundle, tmp_path):
    """Writer and auditor read one contract file: every file of a real bundle is in it, every required one
    is there, the manifest records its version, and no entry of the contract is dead."""
    bundle = tmp_path / "b"
    shutil.copytree(honest_bundle, bundle)
    assert audit_main([str(bundle)]) == 0                     # writes audit.json, the last file of the layout
    assert evidence.bundle_format() == contract.FORMAT
    assert evidence.TABLES == contract.TABLES and evidence.UNMANIFESTED == contract.UNMANIFESTED
    plan = json.loads((bundle / "plan.json").read_text())
    assert contract.layout_strays(bundle, plan) == []
    assert all((bundle / rel).is_file() for rel in contract.layout_required(plan, {"cpu0"}))
    assert json.loads((bundle / "manifest.json").read_text())["format_version"] == contract.VERSION
    files = [p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()]
    domain = contract.layout_domains(plan, set())["optional"]
    for entry in contract.FORMAT["files"]:
        if entry["path"].startswith("online/"):   # the online track's files: tests/audit/test_online.py
            continue
        if entry["path"].startswith("superseded/"):   # only after a resume of a lone arm: tests/audit/test_superseded.py
            continue
        if entry["path"] == "natural/{trace}.json":   # only with natural comparisons: tests/audit/test_natural.py
            assert plan["natural"]["traces"] == []
            continue
        assert any(contract.layout_pattern(entry["path"], domain).fullmatch(f) for f in files), entry["path"]
        assert (REPO / entry["writer"]).is_file(), entry["writer"]


@pytest.mark.parametrize("what", ["raw record", "folder"])
def test_a_symbolic_link_in_the_bundle_is_named(bundle, tmp_path, what):
    """A raw record, or the whole logs/ folder, moved outside the bundle and linked back (the manifest rewritten, it
    hashes the target) audited PASS: a copy of the bundle would hold none of it, and the target can change."""
    outside = tmp_path / "outside"
    outside.mkdir()
    if what == "folder":
        rel, target = "logs", outside / "logs"
        shutil.move(str(bundle / rel), str(target))
    else:
        path = raw(bundle, 3)
        rel, target = path.relative_to(bundle).as_posix(), outside / path.name
        shutil.move(str(path), str(target))
    (bundle / rel).symlink_to(target)
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert f"files: {rel} is a symbolic link (to {target}), not a file of the bundle" in text, text
