"""Coverage counts: how often the paths where the KV layouts differ ran, and that cpu-smoke reaches them.

- the host simulation is the engine's replay: the same decode steps, rows, descriptors and row trace;
- its counts equal a brute-force count over what the engine handed its readers and its native fill
  (the live exit map at every decode step, every fill call);
- the auditor's independent derivation agrees with the harness's on random schedules;
- the checker names counts derived from other rows, and warns about a comparison that never reached
  the difference between its arms;
- the cpu-smoke preset's own workload makes a mutated alias reader that breaks only at tile boundaries,
  or only for depth-1 exits, change output tokens (on the seed's workload both left every token as it was).
"""
import dataclasses
import json
import random

import pytest
import torch

from loopbench.audit import coverage as audit_coverage
from loopbench.harness import checker, conf, coverage, inputs, session, spec
from loopbench.runtime import attention
from loopbench.harness.fixtures import write_synthetic_checkpoint
from loopbench.runtime.api import EngineConfig, Request
from loopbench.runtime.engine import LoopEngine

CPU = {"kind": "cpu", "torch": "cpu", "gpu_index": None, "label": "cpu", "name": "cpu", "uuid": None}
ARMS = {"native": {"kv_layout": "native", "prefix_tiles": False, "tile_size": 8, "cuda_graphs": False},
        "alias": {"kv_layout": "alias", "prefix_tiles": False, "tile_size": 8, "cuda_graphs": False},
        "alias_prefix": {"kv_layout": "alias", "prefix_tiles": True, "tile_size": 8, "cuda_graphs": False}}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as the CPU sessions run: the arms are tiny, and OpenMP threads spinning for
    cores that other processes hold make them many times slower (machine.child_device)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0, dtype=torch.float32)
    return session.load_model(str(path), "float32", CPU, max_model_len=96)


@pytest.fixture(scope="module")
def schedule(model):
    """A natural capture whose exit depths are then redrawn (seeded) over 1..max_loops, so the replay
    reaches every depth, depth-1 exits and first-alias positions on every tile offset; a replay only
    forces the exits, so the redrawn schedule runs like any frozen one."""
    g = torch.Generator().manual_seed(0)
    reqs = [Request(f"r{i:04d}", tuple(torch.randint(0, 256, (n,), generator=g).tolist()), 20, max_loops=m)
            for i, (n, m) in enumerate([(7, 4), (8, 4), (15, 3), (16, 4), (9, 2), (23, 4), (1, 4)])]
    eng = LoopEngine(model, EngineConfig(max_num_seqs=3, max_model_len=96, exit_policy="fixed"))
    for r in reqs:
        eng.add_request(r)
    eng.run()
    data = json.loads(eng.capture_schedule().to_json())
    rng = random.Random(0)
    for r in data["requests"]:
        r["exit_depths"] = [r["max_loops"]] + [rng.randint(1, r["max_loops"]) for _ in r["exit_depths"][1:]]
    data["requests"][1]["exit_depths"] = data["requests"][1]["exit_depths"][:11]   # a natural EOS stop
    return reqs, data


def _replay(model, reqs, data, arm: dict):
    """Replay ``data`` on ``arm``; returns (engine, decode steps as descriptor rows, brute-force counts)."""
    from loopbench.runtime.schedule import Schedule

    sched = Schedule.from_json(json.dumps(data))
    eng = LoopEngine(model, EngineConfig(max_num_seqs=data["max_num_seqs"], max_model_len=96, tile_size=arm["tile_size"],
                                         kv_layout=arm["kv_layout"], prefix_tiles=arm["prefix_tiles"],
                                         exit_policy="replay", schedule=sched))
    T = arm["tile_size"]
    steps, seen = [], {"lower_plane_reads": [0, 0, 0], "routed_reads": 0, "direct_tiles": 0, "boundary_tiles": 0,
                       "boundary_last_key": 0, "fill_token_planes": 0, "padding_rows": 0}
    core, fill = eng.runner.decode_core, eng.runner.backend.native_fill

    def spy_core(row_slot, row_depth, row_pos, row_fa, row_forced):
        every = list(zip(*(t.tolist() for t in (row_slot, row_depth, row_pos, row_fa, row_forced))))
        rows = [r for r in every if r[0] >= 0]       # slot -1: padding to the step's shape
        seen["padding_rows"] += len(every) - len(rows)
        steps.append(rows)
        for s, d, p, fa, _ in rows:   # keys 0..p as the reader sees them: the exit map before this loop
            for e in eng.kv.exit_map[s, :p + 1].tolist():
                if e < d:
                    seen["lower_plane_reads"][e - 1] += 1
            direct = sum(1 for k in range(p + 1) if (k // T + 1) * T <= fa) if arm["prefix_tiles"] else 0
            seen["routed_reads"] += (p + 1 - direct) if arm["kv_layout"] == "alias" else 0
            if arm["prefix_tiles"]:
                seen["direct_tiles"] += len({k // T for k in range(p + 1) if (k // T + 1) * T <= fa})
                seen["boundary_tiles"] += fa <= p
                seen["boundary_last_key"] += fa <= p and fa % T == T - 1
        return core(row_slot, row_depth, row_pos, row_fa, row_forced)

    def spy_fill(k_all, v_all, block_tables, slot, pos, exit_depth, max_depth):
        for s, e, m in zip(slot.tolist(), exit_depth.tolist(), max_depth.tolist()):
            seen["fill_token_planes"] += max(0, m - e) if s >= 0 else 0
        return fill(k_all, v_all, block_tables, slot, pos, exit_depth, max_depth)

    eng.runner.decode_core = spy_core
    eng.runner.backend = dataclasses.replace(eng.runner.backend, native_fill=spy_fill)
    for r in reqs:
        eng.add_request(r)
    eng.run()
    return eng, steps, seen


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_counts_are_what_the_engine_ran(model, schedule, arm):
    reqs, data = schedule
    eng, steps, seen = _replay(model, reqs, data, ARMS[arm])
    sim_steps, trace = coverage.simulate(data, 4)
    assert trace == eng.trace_sha256
    assert [[(r.slot, r.depth, r.pos, r.first_alias, int(r.exits)) for r in step] for step in sim_steps] == steps
    cov = coverage.derive(data, ARMS[arm], 4)
    assert cov["trace_sha256"] == eng.trace_sha256
    assert cov["exits_per_depth"] == [sum(1 for r in data["requests"] for e in r["exit_depths"][1:] if e == d)
                                      for d in (1, 2, 3, 4)]
    if arm != "native":   # native never publishes exits, so its live exit map cannot show the reads
        assert cov["lower_plane_reads"] == seen["lower_plane_reads"]
    assert {k: cov[k] for k in seen if k != "lower_plane_reads"} == {k: v for k, v in seen.items()
                                                                     if k != "lower_plane_reads"}
    assert cov["padding_rows"] == sum(data["max_num_seqs"] - len(step) for step in steps)
    # the workload reaches what the counts are for; the layout-independent counts agree across arms
    assert all(cov["exits_per_depth"]) and all(cov["lower_plane_reads"])
    assert cov["lower_plane_reads"] == coverage.derive(data, ARMS["alias"], 4)["lower_plane_reads"]
    if arm == "alias_prefix":
        assert cov["direct_tiles"] > 0 and cov["boundary_last_key"] > 0


def test_padding_rows_fill_every_decode_step_to_max_num_seqs():
    """Three one-loop requests decode together: their step of 3 rows runs on 8 rows at B8, graphs or not
    (records of schema 3); the auditor still derives a schema-2 record's bucket padding (4 rows, graphs only)."""
    reqs = [{"request_id": f"r{i}", "prompt_sha256": "-", "prompt_len": 2, "max_tokens": 2, "min_loops": 1,
             "max_loops": 1, "exit_threshold": 1.0, "token_ids": [0, 0], "exit_depths": [1, 1]} for i in range(3)]
    data = {"version": 1, "max_num_seqs": 8, "admission_order": ["r0", "r1", "r2"], "requests": reqs,
            "num_steps": 2, "trace_sha256": "-"}
    graphs = {**ARMS["native"], "cuda_graphs": True}
    assert coverage.derive(data, graphs, 4)["padding_rows"] == 5
    assert coverage.derive(data, ARMS["native"], 4)["padding_rows"] == 5                   # no graphs
    assert coverage.derive({**data, "max_num_seqs": 3}, graphs, 4)["padding_rows"] == 0   # a full batch
    for arm in (graphs, ARMS["native"]):
        assert audit_coverage.coverage(data, arm, 4, schema=3) == coverage.derive(data, arm, 4)
    assert audit_coverage.coverage(data, graphs, 4, schema=2)["padding_rows"] == 1          # bucket 4
    assert audit_coverage.coverage(data, ARMS["native"], 4, schema=2)["padding_rows"] == 0


def test_unreplayable_schedule_is_refused():
    reqs = [{"request_id": "r0", "prompt_sha256": "-", "prompt_len": 2, "max_tokens": 2, "min_loops": 1,
             "max_loops": 2, "exit_threshold": 1.0, "token_ids": [0, 0], "exit_depths": [2, 3]}]
    data = {"version": 1, "max_num_seqs": 1, "admission_order": ["r0"], "requests": reqs, "num_steps": 0,
            "trace_sha256": "-"}
    with pytest.raises(ValueError, match="'r0'"):
        coverage.derive(data, ARMS["alias"], 4)
    with pytest.raises(ValueError, match="kv_layout 'paged'"):
        coverage.derive(data, {**ARMS["alias"], "kv_layout": "paged"}, 4)


def test_the_auditor_derives_the_same_counts():
    """Two implementations of the replay rules (harness and audit) agree on random schedules."""
    rng = random.Random(1)
    for _ in range(150):
        reqs = []
        for i in range(rng.randint(1, 9)):
            m, n = rng.randint(1, 4), rng.randint(1, 12)
            stop = n if rng.random() < 0.8 else rng.randint(1, n)    # some stop early (EOS in the capture)
            reqs.append({"request_id": f"r{i:04d}", "prompt_sha256": "-", "prompt_len": rng.randint(1, 70),
                         "max_tokens": n, "min_loops": 1, "max_loops": m, "exit_threshold": 0.5,
                         "token_ids": [0] * stop, "exit_depths": [m] + [rng.randint(1, m) for _ in range(stop - 1)]})
        data = {"version": 1, "max_num_seqs": rng.randint(1, 5), "admission_order": [r["request_id"] for r in reqs],
                "requests": reqs, "num_steps": 0, "trace_sha256": "-"}
        for arm in ARMS.values():
            arm = {**arm, "tile_size": rng.choice([4, 16, 32]), "cuda_graphs": rng.random() < 0.5}
            assert coverage.derive(data, arm, 4) == audit_coverage.coverage(data, arm, 4, schema=3)


# ------------------------------------------------------------------------------------------ checker

def _record(seq, position, arm, cfg, cov, trace="t"):
    return {"job": "cpu0", "seq": seq, "point": "B2C2", "comparison": "native_vs_alias_prefix", "pair": 0,
            "position": position, "arm": arm, "arm_config": cfg, "measured": {"trace_sha256": trace}, "coverage": cov}


def _cov(**counts):
    base = {"exits_per_depth": [1, 2, 0, 3], "lower_plane_reads": [4, 0, 0], "routed_reads": 50, "direct_tiles": 2,
            "boundary_tiles": 3, "boundary_last_key": 1, "fill_token_planes": 0, "padding_rows": 0,
            "trace_sha256": "t"}
    return {**base, **counts}


def test_a_comparison_that_never_reached_the_difference_is_warned():
    reached = [_record(0, "baseline", "native", ARMS["native"], _cov(routed_reads=0, direct_tiles=0)),
               _record(1, "candidate", "alias_prefix", ARMS["alias_prefix"], _cov())]
    assert checker.coverage_warnings(reached) == []
    vacuous = [_record(0, "baseline", "native", ARMS["native"], _cov(lower_plane_reads=[0, 0, 0])),
               _record(1, "candidate", "alias_prefix", ARMS["alias_prefix"],
                       _cov(lower_plane_reads=[0, 0, 0], routed_reads=0, boundary_tiles=0))]
    (warning,) = checker.coverage_warnings(vacuous)
    assert warning.startswith("cpu0 B2C2 native_vs_alias_prefix: no decode row read a key from a plane below")
    assert "arm 'alias_prefix' read no key through the exit map" in warning
    assert "arm 'alias_prefix' met no boundary tile" in warning
    assert "read no key tile directly" not in warning
    same = [dict(r, comparison="aa", arm_config=ARMS["native"]) for r in vacuous]   # A/A: nothing differs
    assert checker.coverage_warnings(same) == []


def test_counts_of_other_rows_are_a_finding():
    recs = [_record(0, "baseline", "native", ARMS["native"], _cov()),
            _record(1, "candidate", "alias_prefix", ARMS["alias_prefix"], _cov(trace_sha256="other"))]
    findings = [f for r in recs for f in checker._coverage_trace_findings(r)]
    assert [(f.kind, f.arm) for f in findings] == [("coverage", "alias_prefix")]


# --------------------------------------------------------------------------- the preset's workload

def _tile_boundary_mutant(row_depth, row_pos, row_slot, row_first_alias, exit_map, max_ctx, *, layout, prefix_tiles,
                          tile_size, _clean=attention.key_planes):
    """Off by one in the direct-tile bound (``tile_end <= first_alias + 1``): wrong only where the first
    aliased position is the last key of its tile."""
    fa = row_first_alias + 1 if prefix_tiles else row_first_alias
    return _clean(row_depth, row_pos, row_slot, fa, exit_map, max_ctx, layout=layout, prefix_tiles=prefix_tiles,
                  tile_size=tile_size)


def _depth1_mutant(row_depth, row_pos, row_slot, row_first_alias, exit_map, max_ctx, *, layout, prefix_tiles,
                   tile_size, _clean=attention.key_planes):
    """Keys of depth-1 exits resolved to plane 2: wrong only where a token exited at depth 1."""
    return _clean(row_depth, row_pos, row_slot, row_first_alias, exit_map.clamp(min=2), max_ctx, layout=layout,
                  prefix_tiles=prefix_tiles, tile_size=tile_size)


def test_cpu_smoke_workload_catches_alias_readers_that_break_only_at_tile_boundaries_or_depth1_exits(
        tmp_path, monkeypatch):
    """Each mutant, run on cpu-smoke's own points and frozen schedules, changes some output token of an
    alias arm's replay against the clean reader's (so the bench's checker sees a token differ from the
    frozen reference). On the seed-like workload of main (P33, ouro_delayed) neither changes any."""
    checked = conf.validate(conf.compose("cpu-smoke"))
    plain = checked.to_plain()
    ckpt = inputs.prepare_checkpoint(checked, tmp_path / "cache")
    prompts = inputs.make_prompts(checked, ckpt["model_config"]["vocab_size"])
    max_len = spec.max_model_len(max(map(len, prompts)), checked.workload.output_len)
    model = session.load_model(ckpt["path"], checked.model.dtype, CPU, max_len)
    caught = {"tile": 0, "depth1": 0}
    for point in plain["points"]:
        reqs = session.build_requests(prompts, point["num_requests"], plain["workload"]["output_len"], plain["exit"])
        natural = LoopEngine(model, checked.arms["native"].engine_config(point["max_num_seqs"], max_len,
                                                                         checked.exit.policy))
        for r in reqs:
            natural.add_request(r)
        natural.run()
        frozen = natural.capture_schedule()

        def replay(arm: str):
            eng = LoopEngine(model, checked.arms[arm].engine_config(point["max_num_seqs"], max_len, "replay", frozen))
            for r in reqs:
                eng.add_request(r)
            return {rid: o.token_ids for rid, o in eng.run().items()}

        clean = {arm: replay(arm) for arm in ("alias", "alias_prefix")}
        for name, mutant, arm in (("tile", _tile_boundary_mutant, "alias_prefix"),
                                  ("depth1", _depth1_mutant, "alias")):
            monkeypatch.setattr(attention, "key_planes", mutant)
            tokens = replay(arm)
            monkeypatch.undo()
            caught[name] += sum(a != b for rid in tokens for a, b in zip(tokens[rid], clean[arm][rid]))
    assert caught["tile"] > 0 and caught["depth1"] > 0, caught
