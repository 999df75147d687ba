"""A session's log (logs/<session>.log) prints each arm it measured, with the elapsed_s and tokens/s it wrote
into the arm's record (documents.log.arm_line): a record whose figures were changed after the run, the log left
as it was, is named, and so is a log line changed or removed to hide it."""
import json

from loopbench.harness import evidence
from tests.audit.tamper import edit_json, failed, forge_elapsed, raw, republish, rewrite_manifest


def _log_lines(bundle):
    path = bundle / "logs" / "cpu0.log"
    return path, path.read_text().split("\n")


def _arm_line_index(lines, rec) -> int:
    key = evidence.FORMAT["documents"]["log"]["arm_line_key"].format(**rec) + ": "
    return next(i for i, line in enumerate(lines) if line[11:].startswith(key))


def test_forged_elapsed_is_named_against_the_sessions_log(bundle):
    """A forger who shortens a candidate run and re-derives tables, summary, report, plot and manifest with the
    harness: every figure agrees with the records, and only the log the session printed at the time does not."""
    rec = forge_elapsed(bundle, 5, lambda r: r["measured"].update(elapsed_s=r["measured"]["elapsed_s"] * 0.9))
    text = failed(bundle)
    named = [d for d in text.split("\n") if d.startswith("logs: logs/cpu0.log line ")]
    assert len(named) == 1, text
    assert f"; record cpu0 seq 5 ({rec['arm']}) gives" in named[0]
    assert f"{rec['measured']['elapsed_s']:.4f}s" in named[0].split("gives")[1]   # the record's figure, not the log's


def test_edited_arm_line_is_named(bundle):
    path, lines = _log_lines(bundle)
    rec = json.loads(raw(bundle, 2).read_text())
    i = _arm_line_index(lines, rec)
    lines[i] = lines[i].replace(f"{rec['tokens_per_s']:.1f} tok/s", f"{rec['tokens_per_s'] * 2:.1f} tok/s")
    path.write_text("\n".join(lines))
    rewrite_manifest(bundle)
    assert f"logs: logs/cpu0.log line {i + 1} reads" in failed(bundle)


def test_removed_arm_line_of_a_completed_session_is_named(bundle):
    path, lines = _log_lines(bundle)
    rec = json.loads(raw(bundle, 6).read_text())
    del lines[_arm_line_index(lines, rec)]
    path.write_text("\n".join(lines))
    rewrite_manifest(bundle)
    assert (f"logs: logs/cpu0.log: record cpu0 seq 6 ({rec['arm']}) has no line, though session cpu0 completed"
            in failed(bundle))


def test_forged_copy_ceiling_is_named_against_the_sessions_log(bundle):
    """Faster copies make every run's fraction of the ceiling smaller; the roofline re-derived from them agrees,
    the ceiling line the session printed does not."""
    edit_json(bundle / "ceilings" / "cpu0.json", lambda c: c.update(times_s=[t / 4 for t in c["times_s"]]))
    republish(bundle)
    ceiling = json.loads((bundle / "ceilings" / "cpu0.json").read_text())
    forged = f"{ceiling['bytes_per_copy'] / min(ceiling['times_s']) / 1e9:.1f} GB/s"
    text = failed(bundle)
    named = [d for d in text.split("\n") if d.startswith("logs: logs/cpu0.log line ")]
    assert len(named) == 1 and f"ceilings/cpu0.json gives 'session cpu0: copy ceiling {forged}'" in named[0], text


def test_removed_copy_ceiling_line_of_a_completed_session_is_named(bundle):
    path, lines = _log_lines(bundle)
    path.write_text("\n".join(line for line in lines if ": copy ceiling " not in line))
    rewrite_manifest(bundle)
    assert "logs: logs/cpu0.log: no copy ceiling line, though session cpu0 completed" in failed(bundle)
