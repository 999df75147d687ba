"""The engine seam: an arm names its engine's factory, and the naive reference generator behind the
``Engine`` protocol runs a whole benchmark, token for token with our engine (float64 on the CPU)."""
import json

import pytest
import torch

from loopbench.audit.auditor import audit
from loopbench.harness import conf, controller, engines, session
from loopbench.harness.records import ArmSpec
from loopbench.runtime.api import Engine
from loopbench.runtime.engine import LoopEngine
from loopbench.runtime.reference import ReferenceEngine

REFERENCE = "loopbench.runtime.reference:make_engine"
CPU = {"kind": "cpu", "torch": "cpu", "gpu_index": None, "label": "cpu", "name": "cpu", "uuid": None}


def _requests(n: int, max_tokens: int, policy_exit: dict) -> list:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (L,), generator=g).tolist() for L in (9, 17, 31, 12, 5)[:n]]
    return session.build_requests(prompts, n, max_tokens, policy_exit)


@pytest.mark.parametrize("policy", ["ouro", "ouro_delayed"])
def test_reference_engine_equals_loop_engine_in_tokens_exits_and_work(model64, policy):
    """Natural run and replay of our engine and the reference engine at B2 with a queue: equal outputs
    and equal work counters (rows per depth, steps...), so the checker holds them to the same reference."""
    exit_conf = {"policy": policy, "threshold": 0.55, "min_loops": 1, "max_loops": 4}
    reqs = _requests(5, 7, exit_conf)
    ours = engines.build_engine(ArmSpec().engine, model64, ArmSpec().engine_config(2, 64, policy))
    naive = engines.build_engine(REFERENCE, model64, ArmSpec(engine=REFERENCE).engine_config(2, 64, policy))
    assert isinstance(ours, LoopEngine) and isinstance(naive, ReferenceEngine) and isinstance(naive, Engine)
    a, b = session.run_phase(ours, reqs, CPU), session.run_phase(naive, reqs, CPU)
    assert b.to_dict()["outputs"] == a.to_dict()["outputs"] and b.work() == a.work()
    assert b.trace_sha256 is None and b.graphs() == {k: 0 for k in a.graphs()}
    assert len({e for o in a.outputs.values() for e in o.exit_depths[1:]}) > 1   # the exits vary
    schedule = ours.capture_schedule()
    replay = engines.build_engine(REFERENCE, model64, ArmSpec(engine=REFERENCE).engine_config(2, 64, "replay",
                                                                                              schedule))
    for _ in range(2):                       # warmup, then the measured run on the same engine
        r = session.run_phase(replay, reqs, CPU)
        assert r.to_dict()["outputs"] == a.to_dict()["outputs"] and r.work() == a.work()
        replay.reset_run()
    with pytest.raises(NotImplementedError):
        naive.capture_schedule()


def test_a_factory_returning_no_engine_is_refused(model64):
    with pytest.raises(TypeError, match="does not satisfy the Engine protocol"):
        engines.build_engine("builtins:slice", model64, ArmSpec().engine_config(2, 64, "ouro"))


@pytest.mark.slow
def test_benchmark_with_a_reference_engine_arm_checks_and_audits(tmp_path):
    """cpu-smoke in float64 with one arm on the reference engine: the reference (our engine's natural run)
    is replayed by both arms token for token, the run completes and the independent audit passes."""
    cfg = conf.compose("cpu-smoke", [
        "name=naive", "model.dtype=float64", "points=[{max_num_seqs:2,num_requests:3}]",
        "workload.prompt_lens=[31,33]", "workload.output_len=6", "pairs=1", f"+arms={{naive:{{engine:\"{REFERENCE}\"}}}}",
        "comparisons=[{baseline:native,candidate:naive}]", "executor.poll_s=0.1",
        f"results_dir={tmp_path / 'results'}", f"cache_dir={tmp_path / 'cache'}"])
    result = controller.run(cfg)
    assert result.summary["status"] == "complete", result.summary["incomplete_reasons"]
    assert result.summary["checks"]["ok"], result.summary["checks"]["findings"]
    plan = json.loads((result.bundle / "plan.json").read_text())
    assert plan["config"]["arms"]["naive"]["engine"] == REFERENCE
    assert plan["config"]["arms"]["native"]["engine"] == "loopbench.runtime.engine:LoopEngine"
    records = [json.loads(p.read_text()) for p in sorted((result.bundle / "raw").glob("*/*.json"))]
    assert {r["arm_config"]["engine"] for r in records if r["arm"] == "naive"} == {REFERENCE}
    assert all(r["measured"]["trace_sha256"] is None for r in records if r["arm"] == "naive")
    assert audit(result.bundle)["status"] == "pass"


def _external_engine(root, body="# v1\n"):
    """A package ``extengine`` under ``root`` whose ``engine.make_engine`` builds our engine."""
    pkg = root / "extengine"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text("from loopbench.runtime.engine import LoopEngine\n\n\n"
                                   "def make_engine(model, config):\n    return LoopEngine(model, config)\n" + body)
    return "extengine.engine:make_engine"


def _fresh_external_engine(root, monkeypatch):
    """:func:`_external_engine` under ``root``, importable, with no ``extengine`` of an earlier test's folder left in
    ``sys.modules`` (an import would find that one, and the hash its files)."""
    import sys

    monkeypatch.syspath_prepend(str(root))
    for name in [m for m in sys.modules if m.split(".")[0] == "extengine"]:
        monkeypatch.delitem(sys.modules, name)
    return _external_engine(root)


def test_an_external_engines_sources_are_hashed_and_ours_are_not(tmp_path, monkeypatch):
    path = _fresh_external_engine(tmp_path, monkeypatch)
    first = engines.source_sha256(path)
    assert len(first) == 64 and engines.source_sha256(path) == first
    (tmp_path / "extengine" / "helpers.py").write_text("X = 1\n")     # another file of its package counts too
    second = engines.source_sha256(path)
    _external_engine(tmp_path, body="# v2\n")
    assert len({first, second, engines.source_sha256(path)}) == 3
    assert engines.source_sha256(REFERENCE) is None                   # ours: code_sha256 covers it
    assert engines.source_sha256("builtins:slice") is None            # no source file to read
    assert engines.engine_sources({"a": {"engine": path}, "b": {"engine": REFERENCE}}) == {
        path: engines.source_sha256(path)}
    with pytest.raises(ValueError, match="cannot be imported"):
        engines.source_sha256("no_such_module_here:make")


def test_a_plan_with_an_external_engine_records_its_sources_and_keys_the_reference_on_them(tmp_path, monkeypatch):
    """The plan's code identity names the external engine's sources (a resume compares the whole plan, so an edit
    to them refuses the resume), and a reference run by it is keyed on them (no stale cached reference)."""
    from loopbench.harness import inputs
    path = _fresh_external_engine(tmp_path, monkeypatch)
    overrides = [f"+arms={{ext:{{engine:\"{path}\"}}}}", "comparisons=[{baseline:ext,candidate:native}]",
                 f"results_dir={tmp_path / 'results'}", f"cache_dir={tmp_path / 'cache'}"]
    spec = conf.validate(conf.compose("cpu-smoke", overrides))
    got = inputs.gather(spec)
    assert got.code["engine_sources"] == {path: engines.source_sha256(path)}
    bundle = tmp_path / "b"
    (bundle / "jobs").mkdir(parents=True)
    controller.reference_job(spec, got, {"sha256": "0" * 64, "path": "ckpt"}, bundle)
    job = json.loads(next((bundle / "jobs").glob("reference*.json")).read_text())
    assert job["spec"]["key_material"]["engine_source_sha256"] == engines.source_sha256(path)
    ours = conf.validate(conf.compose("cpu-smoke", overrides[2:]))
    assert "engine_sources" not in inputs.gather(ours).code


@pytest.mark.slow
def test_a_resume_after_an_edit_to_the_external_engine_is_refused(tmp_path, monkeypatch):
    """Found by a new-user trial: an interrupted run whose candidate engine was then edited resumed, mixing the
    measurements of two versions of it in one bundle."""
    import os

    from loopbench.harness import resume
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    path = _fresh_external_engine(tmp_path, monkeypatch)
    over = ["name=ext", "points=[{max_num_seqs:2,num_requests:3}]", "workload.prompt_lens=[9,12]",
            "workload.output_len=4", "pairs=2", f"+arms={{ext:{{engine:\"{path}\"}}}}",
            "comparisons=[{baseline:native,candidate:ext}]", "executor.poll_s=0.1",
            f"results_dir={tmp_path / 'results'}", f"cache_dir={tmp_path / 'cache'}"]
    result = controller.run(conf.compose("cpu-smoke", over + ["fault.kill_after_arms=2"]))
    assert result.summary["status"] == "incomplete"
    _external_engine(tmp_path, body="# edited after the run was interrupted\n")
    with pytest.raises(resume.ResumeRefused, match="code.engine_sources"):
        controller.run(conf.compose("cpu-smoke", over + [f"resume={result.bundle}"]))


def test_a_dangling_symlink_in_the_engines_package_is_no_crash(tmp_path, monkeypatch):
    """Emacs locks a file being edited with a dangling symlink ``.#engine.py``: a plan made meanwhile hashed the
    package's other files, not a FileNotFoundError traceback (a file that cannot be read is a ValueError naming it)."""
    path = _fresh_external_engine(tmp_path, monkeypatch)
    before = engines.source_sha256(path)
    (tmp_path / "extengine" / ".#engine.py").symlink_to("user@host.1234:1700000000")
    assert engines.source_sha256(path) == before

    def unreadable(self):
        raise PermissionError(13, "Permission denied", str(self))

    with monkeypatch.context() as m:      # root reads any file: a PermissionError stands in for chmod 000
        m.setattr(engines.Path, "read_bytes", unreadable)
        with pytest.raises(ValueError, match=r"cannot read .*extengine.*Permission denied"):
            engines.source_sha256(path)


def test_a_symlinked_folder_of_the_engines_package_is_hashed_and_a_loop_ends(tmp_path, monkeypatch):
    """Python imports through a symlinked subpackage (a kernels folder linked in), so an edit there changes the
    hash; a symlink loop is walked once."""
    path = _fresh_external_engine(tmp_path, monkeypatch)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "__init__.py").write_text("")
    (tmp_path / "shared" / "kernels.py").write_text("TILE = 64\n")
    (tmp_path / "extengine" / "kernels").symlink_to(tmp_path / "shared")
    (tmp_path / "extengine" / "loop").symlink_to(tmp_path / "extengine")
    before = engines.source_sha256(path)
    (tmp_path / "shared" / "kernels.py").write_text("TILE = 128\n")
    assert engines.source_sha256(path) != before


def test_an_engine_under_loopbench_that_code_sha256_does_not_cover_is_hashed():
    """``loopbench.`` names every folder of a source checkout (loopbench/__init__.py puts the repository on its path),
    but code_sha256 hashes only runtime, harness and kernels: an engine in another folder, such as the tests' stall
    engine, is an external engine, and an edit to it must refuse a resume as one elsewhere does."""
    stall = "loopbench.tests.harness.stall_engine:make_engine"
    digest = engines.source_sha256(stall)
    assert digest is not None and digest == engines.source_sha256("tests.harness.stall_engine:make_engine")
    assert engines.engine_sources({"a": {"engine": stall}, "b": {"engine": REFERENCE}}) == {stall: digest}
    assert engines.source_sha256("loopbench.kernels.mlp_block:wait_arrived") is None   # kernels: code_sha256's


def test_a_child_refuses_an_external_engine_whose_sources_are_not_the_planned_ones(tmp_path, monkeypatch):
    """The plan's hash is taken once, by the controller; every child imports the engine afresh (each session, the
    reference child, each online server). One that finds other sources (an edit since, or another copy on its
    sys.path) refuses before it loads a model, naming the engine and code.engine_sources."""
    from loopbench.harness.online import server
    path = _fresh_external_engine(tmp_path, monkeypatch)
    planned = {path: engines.source_sha256(path)}
    engines.check_sources(planned)                               # unchanged: nothing to say
    engines.check_sources({})
    _external_engine(tmp_path, body="# edited after the plan\n")
    with pytest.raises(ValueError, match=r"extengine\.engine:make_engine.*code\.engine_sources.*edited"):
        engines.check_sources(planned)
    with pytest.raises(ValueError, match="code.engine_sources"):  # a reference child, before it reads the bundle
        session.capture_references({"bundle": str(tmp_path / "none"), "name": "reference", "device": CPU,
                                    "spec": {"engine_sources": planned}})
    with pytest.raises(ValueError, match="code.engine_sources"):  # an online server, before it loads the model
        server.build_engine({"engine_sources": planned, "device": CPU})


@pytest.mark.slow
def test_an_edit_to_the_external_engine_between_two_sessions_of_one_run_is_refused(tmp_path, monkeypatch):
    """sessions=2: each session is a fresh process that imports the engine. Its factory edits its own file on its
    first call, as a user editing the engine while a long run goes on would: the second session imported the edited
    version and the bundle came out complete, audited, its plan naming only the first version's hash."""
    import os

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    path = _fresh_external_engine(tmp_path, monkeypatch)
    marker = tmp_path / "edited"
    (tmp_path / "extengine" / "engine.py").write_text(
        "from pathlib import Path\n\nfrom loopbench.runtime.engine import LoopEngine\n\n\n"
        "def make_engine(model, config):\n"
        f"    if not Path({str(marker)!r}).exists():\n"
        f"        Path({str(marker)!r}).write_text('')\n"
        "        Path(__file__).write_text(Path(__file__).read_text() + '# edited by the first session\\n')\n"
        "    return LoopEngine(model, config)\n")
    over = ["name=ext", "points=[{max_num_seqs:2,num_requests:3}]", "workload.prompt_lens=[9,12]",
            "workload.output_len=4", "pairs=2", "sessions=2", f"+arms={{ext:{{engine:\"{path}\"}}}}",
            "comparisons=[{baseline:native,candidate:ext}]", "executor.poll_s=0.1",
            f"results_dir={tmp_path / 'results'}", f"cache_dir={tmp_path / 'cache'}"]
    result = controller.run(conf.compose("cpu-smoke", over))
    assert marker.exists()
    assert result.summary["status"] == "incomplete"
    logs = "".join(p.read_text() for p in (result.bundle / "logs").glob("*.log"))
    assert "code.engine_sources" in logs
