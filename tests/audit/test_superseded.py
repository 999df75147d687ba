"""Records a resume superseded (bundle format 15). A resume of a run stopped between the two arms of a pair measures
the pair again; the lone arm's record, which it deleted, is now kept byte for byte under superseded/<session>/, in the
manifest and in report.md, out of every figure. The auditor holds each such record to a planned run of its session's
job, with its log line, measured again by a later session (audit/check_superseded.py)."""
import json
import shutil
from pathlib import Path

import pytest

from loopbench.harness import conf, controller, resume

from .tamper import audit, edit_json, failed, republish, rewrite_manifest

pytestmark = pytest.mark.slow      # a stopped run and its resume of a tiny model: about 15 s on 2 cores

# 4 arms (2 pairs of one comparison); the first session kills itself after 3, so seq 2 is a lone arm
MINI = ["name=sup", "points=[{max_num_seqs:2,num_requests:3}]", "workload.prompt_len=9", "workload.prompt_lens=null",
        "workload.output_len=3", "pairs=2", "comparisons=[{baseline:native,candidate:alias_prefix}]",
        "executor.poll_s=0.1", "fault.kill_after_arms=3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The stopped bundle (a copy) and the same bundle resumed to completion, with its lone record as it was."""
    root = tmp_path_factory.mktemp("superseded")
    over = MINI + [f"results_dir={root / 'r'}", f"cache_dir={root / 'c'}"]
    first = controller.run(conf.compose("cpu-smoke", over))
    assert first.summary["status"] == "incomplete"
    stopped = Path(shutil.copytree(first.bundle, root / "stopped" / first.bundle.name))
    lone = max((first.bundle / "raw" / "cpu0").glob("*.json"))
    facts = {"lone": lone.name, "bytes": lone.read_bytes(), "report": (first.bundle / "report.md").read_text()}
    result = controller.run(conf.compose("cpu-smoke", over + [f"resume={first.bundle}"]))
    assert result.summary["status"] == "complete", result.summary["incomplete_reasons"]
    return {"over": over, "stopped": stopped, "resumed": first.bundle, **facts}


@pytest.fixture
def bundle(runs, tmp_path) -> Path:
    copy = Path(shutil.copytree(runs["resumed"], tmp_path / runs["resumed"].name))
    (copy / "audit.json").unlink(missing_ok=True)
    return copy


def _aside(bundle: Path, runs: dict, session: str = "cpu0") -> Path:
    return bundle / "superseded" / session / "raw" / "cpu0" / runs["lone"]


def test_the_lone_arm_is_kept_as_measured_and_the_resumed_bundle_passes(runs):
    bundle = runs["resumed"]
    assert runs["lone"].startswith("00002-") and json.loads(runs["bytes"])["session"] == "cpu0"
    assert [p for p in (bundle / "superseded").rglob("*") if p.is_file()] == [_aside(bundle, runs)]
    assert _aside(bundle, runs).read_bytes() == runs["bytes"]
    assert json.loads((bundle / "raw" / "cpu0" / runs["lone"]).read_text())["session"] == "cpu0.r1"   # again
    rel = _aside(bundle, runs).relative_to(bundle).as_posix()
    assert rel in json.loads((bundle / "manifest.json").read_text())["files"]
    verdict = audit(bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    assert verdict["checked"]["superseded_records"] == 1
    report = (bundle / "report.md").read_text()
    lone = json.loads(runs["bytes"])
    assert "## Superseded by a resume" in report and "1 run was measured and then superseded by a resume" in report
    assert f"| {rel} | cpu0 | 2 | {lone['arm']} |" in report
    assert "## Superseded by a resume" not in runs["report"]   # nothing superseded before the resume


def test_a_superseded_record_enters_no_figure(bundle, runs):
    """The bundle published again without its superseded record: every table, the summary and the plot are the same
    bytes, and report.md differs only by the section that lists it."""
    figures = ["summary.json", "pair_ratios.png", *(f"tables/{p.name}" for p in (bundle / "tables").iterdir())]
    before = {rel: (bundle / rel).read_bytes() for rel in figures}
    report = (bundle / "report.md").read_text()
    shutil.rmtree(bundle / "superseded")
    republish(bundle)
    assert {rel: (bundle / rel).read_bytes() for rel in figures} == before
    without = (bundle / "report.md").read_text()
    section = report[report.index("\n## Superseded by a resume"):report.index("\n![paired ratios]")]
    assert without == report.replace(section, "") != report


def _copy_of_a_record_never_superseded(bundle: Path, runs: dict) -> None:
    first = min((bundle / "raw" / "cpu0").glob("*.json"))   # seq 0, measured once, by cpu0
    shutil.copy(first, _aside(bundle, runs).parent / first.name)


def _record_of(bundle: Path, runs: dict, edit, session: str = "cpu0", name: str | None = None) -> None:
    """The superseded record edited by ``edit``, moved to ``session``'s folder under ``name`` where given."""
    path = _aside(bundle, runs)
    edit_json(path, edit)
    dest = _aside(bundle, runs, session).with_name(name or path.name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    path.rename(dest)


FORGERIES = {
    "a copy of a record no resume superseded": (
        _copy_of_a_record_never_superseded,
        "superseded: superseded/cpu0/raw/cpu0/00000-B2C3-native_vs_alias_prefix-p0-{first}.json was not measured "
        "again: raw/cpu0/00000-B2C3-native_vs_alias_prefix-p0-{first}.json is of session cpu0, not of a session after "
        "cpu0 in children.json"),
    "a run the plan does not hold": (
        lambda b, runs: _record_of(b, runs, lambda r: r.update(seq=99), name="00099" + runs["lone"][5:]),
        "is not at its planned place"),
    "a run of another config": (
        lambda b, runs: _record_of(b, runs, lambda r: r["arm_config"].update(tile_size=7)),
        "ran a config other than planned"),
    "a session children.json does not list": (
        lambda b, runs: _record_of(b, runs, lambda r: r.update(session="cpu0.r7"), "cpu0.r7"),
        "session 'cpu0.r7' is not a session of cpu0 in children.json"),
    "the session that measured the pair again": (
        lambda b, runs: _record_of(b, runs, lambda r: r.update(session="cpu0.r1"), "cpu0.r1"),
        "is of session cpu0.r1, not of a session after cpu0.r1 in children.json"),
    "in another session's folder": (
        lambda b, runs: _record_of(b, runs, lambda r: None, "cpu0.r1"),
        "superseded: superseded/cpu0.r1/raw/cpu0/{lone} holds cpu0 seq 2 of session cpu0, whose place is "
        "superseded/cpu0/raw/cpu0/{lone}"),
    "a changed measurement": (
        lambda b, runs: edit_json(_aside(b, runs), lambda r: r["measured"].update(elapsed_s=2 * r["measured"]["elapsed_s"])),
        "superseded record cpu0 seq 2"),
}


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_forged_superseded_record_is_named(bundle, runs, forgery):
    forge, named = FORGERIES[forgery]
    first = json.loads(min((bundle / "raw" / "cpu0").glob("*.json")).read_text())["position"]
    forge(bundle, runs)
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert named.format(lone=runs["lone"], first=first) in text, text


def test_a_superseded_record_outside_the_manifest_is_named(bundle, runs):
    rel = _aside(bundle, runs).relative_to(bundle).as_posix()
    edit_json(bundle / "manifest.json", lambda m: m["files"].pop(rel))
    assert f"manifest: {rel} is in the bundle but not in the manifest" in failed(bundle)


def test_a_format_14_bundle_has_no_superseded_records(bundle, runs):
    """Format 14 deleted a lone arm's record: a superseded/ file in a bundle claiming it is a stray of its layout."""
    edit_json(bundle / "manifest.json", lambda m: m.update(format_version=14))
    rewrite_manifest(bundle)
    rel = _aside(bundle, runs).relative_to(bundle).as_posix()
    assert f"layout: {rel} is not a file of the bundle layout" in failed(bundle)


def test_a_resume_never_overwrites_a_superseded_record(runs, tmp_path):
    """Where the resume would keep the lone record a file lies already (no resume writes one there: the session that
    measured a record measured it once), the resume is refused before anything changes, as plan refuses it."""
    bundle = Path(shutil.copytree(runs["stopped"], tmp_path / runs["stopped"].name))
    there = _aside(bundle, runs)
    there.parent.mkdir(parents=True)
    there.write_text("{}\n")
    rewrite_manifest(bundle)
    before = {p: p.read_bytes() for p in bundle.rglob("*") if p.is_file()}
    spec = conf.validate(conf.compose("cpu-smoke", runs["over"] + [f"resume={bundle}"]))
    with pytest.raises(resume.ResumeRefused, match=f"superseded/cpu0/raw/cpu0/{runs['lone']} exists already"):
        resume.check_resume(spec)
    with pytest.raises(ValueError, match="a superseded record is never overwritten"):
        controller.run(conf.compose("cpu-smoke", runs["over"] + [f"resume={bundle}"]))
    assert {p: p.read_bytes() for p in bundle.rglob("*") if p.is_file()} == before
