"""A frozen reference's prompt_len is its prompt's length; a point's requests run distinct prompts."""
import json

from tests.audit.tamper import edit_json, failed, rewrite_manifest


def _reference(bundle):
    plan = json.loads((bundle / "plan.json").read_text())
    pt = next(p for p in plan["points"] if p.get("reference"))
    return plan, pt


def test_reference_prompt_len_other_than_its_prompt_is_named(bundle):
    plan, pt = _reference(bundle)
    edit_json(bundle / pt["reference"]["file"], lambda s: s["requests"][0].update(prompt_len=22))
    rewrite_manifest(bundle)
    assert (f"reference: {pt['key']} request r0000: prompt_len 22 is not the 17 tokens of prompts.json[0]"
            in failed(bundle))


def test_duplicate_prompt_index_in_a_point_is_named(bundle):
    def forge(plan):
        plan["points"][0]["requests"][1]["prompt_index"] = 0
    edit_json(bundle / "plan.json", forge)
    rewrite_manifest(bundle)
    assert "lists prompt_index 0 for 2 requests" in failed(bundle)
