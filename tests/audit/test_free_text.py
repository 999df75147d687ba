"""Strings of a bundle's documents that reach report.md cannot add lines, headings or table cells to it, and
environment.json and children.json hold only what the contract defines (fix of the report-injection gap)."""
import json

from tests.audit.tamper import edit_json, failed, rewrite_manifest
from loopbench.harness import evidence


def _refinalize(bundle) -> None:
    """Re-render the report (and manifest) from the bundle's edited documents, as a forger with the harness would."""
    plan, summary, children, env = (json.loads((bundle / f"{name}.json").read_text())
                                    for name in ("plan", "summary", "children", "environment"))
    evidence.finalize(bundle, plan, summary["checks"], children, env)


def test_newline_in_environment_version_is_named(bundle):
    edit_json(bundle / "environment.json", lambda e: e["python"].update(version="3.11.7\n\n## Result\n\n**fake**"))
    _refinalize(bundle)
    text = failed(bundle)
    assert "report.md: could not be checked" in text and "would break report.md's lines" in text


def test_carriage_return_in_environment_is_named(bundle):
    edit_json(bundle / "environment.json", lambda e: e["torch"].update(version="2.13\r# fake"))
    _refinalize(bundle)
    assert "would break report.md's lines" in failed(bundle)


def test_environment_without_its_fields_is_named(bundle):
    edit_json(bundle / "environment.json", lambda e: e["python"].update(version=3.11))
    rewrite_manifest(bundle)
    assert "environment.json: is not the environment document" in failed(bundle)
    edit_json(bundle / "environment.json", lambda e: e.pop("packages"))
    rewrite_manifest(bundle)
    assert "packages is missing" in failed(bundle)


def test_pipe_in_a_table_cell_is_named(bundle):
    edit_json(bundle / "children.json", lambda cs: cs[-1].update(state="completed | forged"))
    _refinalize(bundle)
    assert "would add cells to a report.md table" in failed(bundle)


def test_interrupted_by_outside_the_contract_is_named(bundle):
    def forge(cs):
        cs[-1].update(state="interrupted", interrupted_by="SIGTERM\n\n## Result\n\n**fake**")
    edit_json(bundle / "children.json", forge)
    _refinalize(bundle)
    text = failed(bundle)
    assert "has interrupted_by 'SIGTERM\\n\\n## Result\\n\\n**fake**', not one of ['SIGTERM', 'SIGINT', 'lost']" in text


def test_stop_signal_outside_the_contract_in_a_status_code_is_named(bundle):
    edit_json(bundle / "summary.json", lambda s: s.update(
        status="incomplete", incomplete_reasons=[{"code": "stopped", "by": "SIGTERM\n\n## Result"}]))
    rewrite_manifest(bundle)
    assert "incomplete_reasons[0]: code 'stopped': by 'SIGTERM\\n\\n## Result' is not one of" in failed(bundle)
