"""A frozen reference's prompt_len is its prompt's length; a point's requests run distinct prompts; a seeded pool is
the contract's (format 15, documents.plan.prompt_rule)."""
import hashlib
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


def test_a_prompt_that_is_not_the_seeded_rules_is_named(bundle):
    """One token of prompts.json[1] changed and plan.json's prompts sha256 re-hashed (a forger's): the pool is not
    the one documents.plan.prompt_rule gives the plan's seed, points and vocabulary."""
    path = bundle / "prompts.json"
    prompts = json.loads(path.read_text())
    prompts[1][5] = (prompts[1][5] + 1) % 256
    path.write_text(json.dumps(prompts))
    edit_json(bundle / "plan.json", lambda p: p["prompts"].update(sha256=hashlib.sha256(path.read_bytes()).hexdigest()))
    rewrite_manifest(bundle)
    assert "plan: prompts.json is not the seeded pool of the contract's documents.plan.prompt_rule: 1 of its 3 " \
           "prompts differ from the rule's 3, the first prompts.json[1]" in failed(bundle)
