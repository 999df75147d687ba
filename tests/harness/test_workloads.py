"""Per-point workloads (harness/workloads.py): a point's own prompt_len / output_len, checked before anything
runs, its prompts a block of the pool, and the `cpu-context` preset end to end (references, checker,
tokens/s, report and audit all on each point's P and D); changing a point's workload fails the audit."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from loopbench.audit.auditor import audit
from loopbench.harness import conf, draws, inputs, plan as plan_mod, workloads
from loopbench.harness.evidence import FORMAT
from tests.audit.tamper import REPO, edit_json, failed, raw, rewrite_manifest

pytestmark = pytest.mark.slow      # its bundles take about 35 s on 2 cores


def _spec(name="cpu-context", overrides=()):
    return conf.validate(conf.compose(name, list(overrides)))


def test_point_keys_carry_the_workload_a_point_sets_itself():
    spec = _spec()
    assert [p.key for p in spec.points] == ["B3C4P24D12", "B3C4P80D8"]
    assert [workloads.output_len(spec, p) for p in spec.points] == [12, 8]
    mixed = _spec(overrides=["points=[{max_num_seqs:3,num_requests:4},{max_num_seqs:3,num_requests:4,prompt_len:40}]"])
    assert [p.key for p in mixed.points] == ["B3C4", "B3C4P40"]


@pytest.mark.parametrize("override, message", [
    ("points=[{max_num_seqs:3,num_requests:4,prompt_len:0}]", "points[0].prompt_len must be"),
    ("points=[{max_num_seqs:3,num_requests:4,output_len:-2}]", "points[0].output_len must be"),
    ("points=[{max_num_seqs:3,num_requests:4,prompt_len:9},{max_num_seqs:3,num_requests:4,prompt_len:9}]",
     "points[1] = B3/C4/P9 is listed twice"),
    ("points=[{max_num_seqs:3,num_requests:4,output_len:32},{max_num_seqs:3,num_requests:4}]",
     "points[1] = B3/C4 runs the same requests as points[0] = B3/C4/D32"),
    ("points=[{max_num_seqs:3,num_requests:4,prompt_len:x}]", "prompt_len"),
])
def test_bad_point_workload_is_refused_by_name(override, message):
    with pytest.raises(Exception, match=message.replace("[", r"\[").replace("]", r"\]")):
        _spec(overrides=[override])


def test_point_prompt_len_with_a_prompts_file_is_refused(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("[1, 2, 3]\n" * 5)
    with pytest.raises(ValueError, match=r"points\[0\].prompt_len=24 needs seeded prompts"):
        _spec(overrides=[f"workload.prompts_file={f}", "workload.prompt_lens=null"])


def test_a_point_longer_than_the_model_is_refused_before_anything_runs():
    spec = _spec(overrides=["points=[{max_num_seqs:3,num_requests:4,prompt_len:1020,output_len:8}]"])
    with pytest.raises(ValueError, match=r"points\[0\] \(B3C4P1020D8\): prompt 1020 \+ output 8 - 1 = 1027 positions"):
        inputs.gather(spec)


def _prompt_rule(seed: str, index: int, length: int, vocab: int) -> list[int]:
    """documents.plan.prompt_rule as its text reads: the digests of 'loopbench prompt <seed> <index> <block>' for
    block 0, 1, ..., each as 8 big-endian 32-bit words; a word below 2**32 - (2**32 mod V) is token word mod V."""
    tokens, block = [], 0
    while len(tokens) < length:
        digest = hashlib.sha256(f"loopbench prompt {seed} {index} {block}".encode()).digest()
        for at in range(0, 32, 4):
            word = int.from_bytes(digest[at:at + 4], "big")
            if word < 2 ** 32 - 2 ** 32 % vocab:
                tokens.append(word % vocab)
        block += 1
    return tokens[:length]


def test_each_prompt_length_is_a_seeded_block_of_the_pool():
    spec = _spec()
    got = inputs.gather(spec)
    assert [len(p) for p in got.prompts] == [24] * 4 + [80] * 4 and got.max_model_len == 80 + 8 - 1
    assert spec.workload.prompt_seed == 1   # cpu-smoke's, which cpu-context keeps
    assert got.prompts[:4] == [_prompt_rule("1,24", j, 24, 256) for j in range(4)]
    assert got.prompts[4:] == [_prompt_rule("1,80", j, 80, 256) for j in range(4)]
    entries = plan_mod.point_entries(spec)
    assert [[q["prompt_index"] for q in e["requests"]] for e in entries] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [(e["prompt_len"], e["output_len"]) for e in entries] == [(24, 12), (80, 8)]
    smoke = _spec("cpu-smoke")   # no point of its own: the workload's pool, prompt i of length prompt_lens[i % 4]
    assert inputs.gather(smoke).prompts == [_prompt_rule("1", i, n, 256) for i, n in enumerate([31, 32, 63, 33] * 2)]
    assert [e["output_len"] for e in plan_mod.point_entries(smoke)] == [32, 32]


def test_the_prompt_pool_follows_the_contracts_rule_without_numpys_generator(monkeypatch):
    """Format 15 (contract documents.plan.prompt_rule): the same config gives the same prompts on any numpy, since
    numpy's Generator, whose stream numpy does not promise across its versions, is not used (a default_rng that
    raises changes nothing); every id lies in [0, vocab_size)."""
    def no_generator(*args, **kwargs):
        raise AssertionError("the prompts drew from numpy.random.default_rng")
    monkeypatch.setattr(np.random, "default_rng", no_generator)
    rule = FORMAT["documents"]["plan"]
    assert rule["prompt_rule_since"] == 15 <= FORMAT["version"]
    assert rule["prompt_message"].format(seed="0,80", index=1, block=2) == "loopbench prompt 0,80 1 2"
    spec = _spec(overrides=["workload.prompt_seed=7", "workload.prompt_lens=[3,70]",
                            "points=[{max_num_seqs:3,num_requests:5},{max_num_seqs:3,num_requests:2,prompt_len:40},"
                            "{max_num_seqs:3,num_requests:3,prompt_len:40}]"])
    pool = inputs.make_prompts(spec, 49152) + workloads.point_prompts(spec, 49152)
    assert pool == [_prompt_rule("7", i, n, 49152) for i, n in enumerate([3, 70] * 3)][:5] + \
        [_prompt_rule("7,40", j, 40, 49152) for j in range(3)]
    assert pool == inputs.make_prompts(spec, 49152) + workloads.point_prompts(spec, 49152)   # seeded: the same again
    assert all(0 <= t < 49152 for p in pool for t in p) and len({t for p in pool for t in p}) > 200


def test_a_word_past_the_last_whole_multiple_of_the_vocabulary_is_skipped():
    """Rejection: with V = 3 * 2**30 a quarter of the 32-bit words lie at or past 2**32 - (2**32 mod V) and are
    skipped, so every id stays equally likely (w mod V would give ids below 2**30 twice the odds)."""
    vocab = 3 * 2 ** 30
    got = draws.prompt_tokens([1], 0, 64, vocab)
    assert got == _prompt_rule("1", 0, 64, vocab) and len(got) == 64 and all(0 <= t < vocab for t in got)
    words = [int.from_bytes(hashlib.sha256(f"loopbench prompt 1 0 {b}".encode()).digest()[at:at + 4], "big")
             for b in range(8) for at in range(0, 32, 4)]
    assert any(w >= vocab for w in words[:len(got)])      # some words were skipped on the way
    assert got != [w % vocab for w in words[:64]]


@pytest.fixture(scope="session")
def context_run(tmp_path_factory):
    """`python -m loopbench.harness.bench --config-name cpu-context`: (bundle, stdout)."""
    root = tmp_path_factory.mktemp("context")
    proc = subprocess.run([sys.executable, "-m", "loopbench.harness.bench", "--config-name", "cpu-context",
                           f"results_dir={root / 'r'}", f"cache_dir={root / 'c'}", "executor.poll_s=0.1"],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (bundle,) = (root / "r").iterdir()
    return bundle, proc.stdout


@pytest.fixture
def cbundle(context_run, tmp_path):
    copy = tmp_path / context_run[0].name
    shutil.copytree(context_run[0], copy)
    return copy


def test_context_preset_runs_every_point_on_its_own_workload(context_run):
    bundle, stdout = context_run
    assert "audit PASS" in stdout and json.loads((bundle / "audit.json").read_text())["status"] == "pass"
    arms = pd.read_parquet(bundle / "tables" / "arms.parquet")
    assert dict(arms.groupby("point")["output_len"].first()) == {"B3C4P24D12": 12, "B3C4P80D8": 8}
    assert np.allclose(arms["tokens_per_s"], arms["num_requests"] * arms["output_len"] / arms["elapsed_s"])
    reqs = pd.read_parquet(bundle / "tables" / "requests.parquet").merge(arms[["job", "seq", "output_len"]])
    assert (reqs["num_tokens"] == reqs["output_len"]).all()
    for point, p_len in (("B3C4P24D12", 24), ("B3C4P80D8", 80)):
        sched = json.loads((bundle / "references" / f"{point}.schedule.json").read_text())
        assert {r["prompt_len"] for r in sched["requests"]} == {p_len}
    text = (bundle / "report.md").read_text()
    for line in ("| Device | B / C | P / D | native (baseline) tokens/s | alias (candidate) tokens/s |",
                 "| CPU | 3 / 4 | 24 / 12 |", "| CPU | 3 / 4 | 80 / 8 |", "## Graph coverage", "No telemetry: NVML was not available"):
        assert line in text, line


def test_changed_point_workload_is_named(cbundle):
    edit_json(cbundle / "plan.json", lambda p: p["points"][0].update(output_len=13))
    rewrite_manifest(cbundle)
    text = failed(cbundle)
    assert "plan: point B3C4P24D12: prompt_len 24 / output_len 13, its config entry config.points[0] gives 24 / 12" in text
    assert "D12, the plan says B3/C4/D13" in text


def test_point_request_on_a_prompt_of_another_length_is_named(cbundle):
    edit_json(cbundle / "plan.json", lambda p: p["points"][1]["requests"][0].update(prompt_index=0))
    rewrite_manifest(cbundle)
    text = failed(cbundle)
    assert "point B3C4P80D8 request r0000: prompts.json[0] has 24 tokens, the point's prompt_len is 80" in text


def test_record_of_another_output_len_is_named(cbundle):
    edit_json(raw(cbundle, 0), lambda r: r.update(output_len=32, tokens_per_s=r["tokens_per_s"] * 32 / r["output_len"]))
    rewrite_manifest(cbundle)
    assert "B3/C4/D32, the plan says B3/C4/D12" in failed(cbundle)
