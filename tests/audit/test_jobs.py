"""jobs/*.json, what each child was asked to do, against the plan: a plan that names other code or another
checkpoint than its reference child was keyed by, or a job file edited to tell another story, is named."""
import json

import pytest

from loopbench.audit import contract
from tests.audit.tamper import edit_json, failed, republish, rewrite_manifest

FORGED = "0" * 64


def test_plan_naming_other_code_is_named_against_the_reference_job(bundle):
    """report.md's header re-rendered from the forged plan agrees with it; the job the reference child ran does not."""
    code = json.loads((bundle / "plan.json").read_text())["code"]["code_sha256"]
    edit_json(bundle / "plan.json", lambda plan: plan["code"].update(code_sha256=FORGED))
    republish(bundle)
    assert (f"jobs: jobs/reference-cpu0.json: spec.key_material.code_sha256 is {code!r}, where plan.json "
            f"code.code_sha256 gives {FORGED!r}") in failed(bundle)


def test_job_and_plan_naming_other_code_are_named_against_the_references_cache_key(bundle):
    """The job forged with the plan still disagrees with the key each frozen reference's meta was written under."""
    edit_json(bundle / "plan.json", lambda plan: plan["code"].update(code_sha256=FORGED))
    edit_json(bundle / "jobs" / "reference-cpu0.json", lambda job: job["spec"]["key_material"].update(code_sha256=FORGED))
    republish(bundle)
    text = failed(bundle)
    assert "jobs: references/B2C3.meta.json: cache_key is " in text and "jobs/reference-cpu0.json's key material" in text


@pytest.mark.parametrize("rel, forge, message", [
    ("jobs/reference-cpu0.json", lambda job: job["spec"]["exit"].update(threshold=0.9),
     "jobs/reference-cpu0.json: spec.exit.threshold is 0.9, where plan.json config.exit gives"),
    ("jobs/reference-cpu0.json", lambda job: job["spec"]["arm_config"].update(kv_layout="alias"),
     "jobs/reference-cpu0.json: spec.arm_config.kv_layout is 'alias', where plan.json config.arms.native gives 'native'"),
    ("jobs/session-cpu0.json", lambda job: job["device"].update(kind="cuda", gpu_index=0),
     "jobs/session-cpu0.json: device.kind is 'cuda', where plan.json devices entry cpu0 gives 'cpu'"),
    ("jobs/session-cpu0.json", lambda job: job.update(seqs=[0, 999]),
     "jobs/session-cpu0.json: seqs [999] are not in plan.json's order of cpu0"),
    ("jobs/session-cpu0.json", lambda job: job.update(session="cpu0.r1"),
     "jobs/session-cpu0.json is a 'session' job of 'cpu0' (session 'cpu0.r1')"),
    ("jobs/session-cpu0.json", lambda job: job.update(note="forged"),
     f"jobs/session-cpu0.json is not the job document of {contract.WHERE}: note is a field that"),
])
def test_forged_job_file_is_named(bundle, rel, forge, message):
    edit_json(bundle / rel, forge)
    rewrite_manifest(bundle)
    assert f"jobs: {message}" in failed(bundle)
