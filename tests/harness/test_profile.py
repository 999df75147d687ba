"""The profile summary on synthetic traces: busy time as a union, idle share, attribution of kernels to the
decode/prefill ranges through correlation ids, top kernels, rendering; and the torch side on the CPU."""
import json

import pytest
import torch

from loopbench.harness.profile import (TraceEvent, annotate_runner, events_from_chrome_trace, figure_lines,
                                       profile_call, render_markdown, short_kernel_name, summarize, union_us,
                                       write_report)


def rng(name, ts, dur, tid=1):
    return TraceEvent("user_annotation", f"loopbench::{name}", ts, dur, tid)


def launch(ts, corr, name="cudaLaunchKernel", tid=1, dur=2.0):
    return TraceEvent("cuda_runtime", name, ts, dur, tid, corr)


def kernel(ts, dur, corr, name="k", cat="kernel"):
    return TraceEvent(cat, name, ts, dur, 7, corr)


def test_overlapping_kernels_count_once_in_busy_time_and_idle_share():
    evs = [kernel(0, 10, 1), kernel(5, 10, 2), kernel(20, 5, 3), kernel(21, 1, 4)]   # union [0,15] + [20,25]
    s = summarize(evs, wall_s=100e-6)
    assert s.kernel_busy_s == pytest.approx(20e-6)
    assert s.idle_share == pytest.approx(0.8)
    assert s.num_kernels == 4
    assert union_us([(3, 4), (0, 1), (0.5, 2)]) == pytest.approx(3.0)


def test_memcpy_and_memset_are_separate_from_kernel_busy_time():
    evs = [kernel(0, 10, 1), kernel(0, 4, 2, cat="gpu_memcpy"), kernel(2, 4, 3, cat="gpu_memcpy"),
           kernel(50, 1, 4, cat="gpu_memset")]
    s = summarize(evs, wall_s=1e-4)
    assert s.kernel_busy_s == pytest.approx(10e-6) and s.num_kernels == 1
    assert s.memcpy_busy_s == pytest.approx(6e-6) and s.num_memcpy == 2
    assert s.memset_busy_s == pytest.approx(1e-6) and s.num_memset == 1


def test_kernels_are_attributed_to_ranges_through_their_launch_correlation():
    evs = [rng("decode", 0, 100), rng("decode", 400, 100), rng("prefill", 200, 100),
           launch(10, 1, "cudaGraphLaunch"), launch(410, 2, "cudaGraphLaunch"),
           launch(250, 3), launch(150, 4),                      # 150: between ranges -> other
           TraceEvent("cuda_driver", "cuLaunchKernel", 290, 20, 1, 5),   # starts inside prefill, ends after it
           kernel(1000, 10, 1, "a"), kernel(1010, 10, 1, "b"), kernel(1020, 10, 2, "a"), kernel(1030, 10, 2, "b"),
           kernel(1040, 30, 3, "p"), kernel(1070, 5, 5, "p"), kernel(1080, 5, 4, "x"),
           kernel(1090, 5, 99, "y"), kernel(1095, 5, 0, "y")]   # no launch known / no correlation -> other
    s = summarize(evs, wall_s=1e-3)
    d, p, o = s.part("decode"), s.part("prefill"), s.part("other")
    assert (d.ranges, d.kernels, d.kernels_per_range) == (2, 4, 2.0)
    assert (p.ranges, p.kernels, p.kernels_per_range) == (1, 2, 2.0)
    assert (o.ranges, o.kernels, o.kernels_per_range) == (0, 3, 0.0)
    assert d.gpu_s == pytest.approx(40e-6) and p.gpu_s == pytest.approx(35e-6) and o.gpu_s == pytest.approx(15e-6)
    assert d.share_of_kernel_time + p.share_of_kernel_time + o.share_of_kernel_time == pytest.approx(1.0)
    assert (s.graph_launches, s.graph_launches_without_kernels) == (2, 0)


def test_innermost_range_wins_and_other_threads_ranges_do_not_claim_a_launch():
    evs = [rng("prefill", 0, 100), rng("decode", 10, 20),       # decode nested in prefill
           rng("decode", 0, 1000, tid=2),                      # another thread's range
           launch(15, 1), launch(50, 2), launch(500, 3),
           kernel(600, 1, 1), kernel(601, 1, 2), kernel(602, 1, 3)]
    s = summarize(evs, wall_s=1e-3)
    assert s.part("decode").kernels == 1 and s.part("prefill").kernels == 1 and s.part("other").kernels == 1


def test_launches_on_a_thread_without_ranges_fall_back_to_the_single_thread_of_ranges():
    evs = [rng("decode", 0, 100, tid=11), launch(10, 1, tid=999), kernel(200, 1, 1)]
    assert summarize(evs, wall_s=1e-3).part("decode").kernels == 1


def test_graph_launch_without_kernel_records_is_counted_and_warned():
    evs = [rng("decode", 0, 100), launch(10, 1, "cudaGraphLaunch"), launch(50, 2, "cudaGraphLaunch"), kernel(200, 1, 1)]
    s = summarize(evs, wall_s=1e-3)
    assert (s.graph_launches, s.graph_launches_without_kernels) == (2, 1)
    assert any("1 of 2 CUDA graph launches have no kernel records" in line for line in figure_lines(s))


def test_top_kernels_are_ordered_by_total_time_with_shares_of_busy_time():
    evs = [kernel(0, 10, 1, "A"), kernel(10, 20, 2, "A"), kernel(30, 50, 3, "B"), kernel(80, 20, 4, "C"),
           kernel(100, 5, 5, "D")]
    s = summarize(evs, wall_s=1e-3, top_n=3)
    assert [k.name for k in s.top_kernels] == ["B", "A", "C"]
    b, a, _ = s.top_kernels
    assert (a.count, a.total_ms, a.mean_us) == (2, pytest.approx(0.03), pytest.approx(15.0))
    assert b.share_of_busy == pytest.approx(50 / 105) and a.share_of_busy == pytest.approx(30 / 105)
    assert len(summarize(evs, wall_s=1e-3, top_n=0).top_kernels) == 0


def test_empty_trace_gives_zeros_without_dividing_by_zero():
    for wall in (0.0, 1.0):
        s = summarize([], wall_s=wall)
        assert (s.kernel_busy_s, s.idle_share, s.memcpy_busy_s, s.num_kernels, s.top_kernels) == (0.0, 0.0, 0.0, 0, ())
        assert all((r.ranges, r.kernels, r.kernels_per_range, r.gpu_s, r.share_of_kernel_time) == (0, 0, 0.0, 0.0, 0.0)
                   for r in s.parts)
        assert not s.has_gpu_activity
    s = summarize([rng("decode", 0, 5), launch(1, 1)], wall_s=1.0)     # CPU run: ranges but no GPU activity
    assert s.part("decode").ranges == 1 and s.idle_share == 0.0
    with pytest.raises(ValueError, match="wall_s"):
        summarize([], wall_s=-1.0)


def test_short_kernel_names():
    assert short_kernel_name("void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>, "
                             "at::detail::Array<char*, 3> >(int, at::native::AddFunctor<float>, at::detail::Array<char*, 3>)") \
        == "vectorized_elementwise_kernel<4, AddFunctor<float>, Array<char*, 3> >"
    assert short_kernel_name("void (anonymous namespace)::softmax_warp_forward<float>(float*, int)") == "softmax_warp_forward<float>"
    assert short_kernel_name("_rmsnorm_residual_kernel") == "_rmsnorm_residual_kernel"
    assert short_kernel_name("sm90_xmma_gemm_" + "x" * 200, width=20) == "sm90_xmma_gemm_xxxx…"


def test_events_from_chrome_trace_keeps_the_categories_it_reads():
    doc = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 5, "ts": 1.5, "dur": 3.0, "args": {"External id": 2}},
        {"ph": "X", "cat": "user_annotation", "name": "loopbench::decode", "pid": 1, "tid": 5, "ts": 1.0, "dur": 9.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 1, "tid": 5, "ts": 2.0, "dur": 4.0,
         "args": {"External id": 3, "cbid": 311, "correlation": 42}},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 20.25, "dur": 1.5,
         "args": {"External id": 3, "correlation": 42, "stream": 7, "grid": [1, 1, 1]}},
        {"ph": "s", "id": 42, "pid": 1, "tid": 5, "ts": 2.0, "cat": "ac2g", "name": "ac2g"}]}
    evs = events_from_chrome_trace(doc)
    assert [e.cat for e in evs] == ["user_annotation", "cuda_runtime", "kernel"]
    assert evs[2] == TraceEvent("kernel", "k", 20.25, 1.5, 7, 42)
    s = summarize(evs, wall_s=1e-4)
    assert s.part("decode").kernels == 1 and s.graph_launches_without_kernels == 0
    with pytest.raises(TypeError, match="Chrome trace"):
        events_from_chrome_trace({"events": []})


def synthetic_summary():
    evs = [rng("decode", 0, 100), launch(10, 1, "cudaGraphLaunch"),
           kernel(0, 600, 1, "void at::native::gemm<float>(int)"), kernel(600, 300, 1, "rms|norm")]
    return summarize(evs, wall_s=1e-3)


def test_markdown_holds_parameters_figures_parts_and_top_kernels():
    md = render_markdown("replay: one run", {"preset": "ouro-1.4b", "B": 16}, synthetic_summary())
    assert md.startswith("## replay: one run")
    assert "| preset | ouro-1.4b |" in md and "| B | 16 |" in md
    assert "GPU idle 10.0% of wall" in md and "GPU kernel-busy 0.9 ms" in md
    assert "kernels per decode step 2.0 (1 steps)" in md
    assert "| decode | 1 | 2 | 2.0 | 0.90 | 100.0% |" in md
    assert "| 1 | `gemm<float>` | 1 | 0.60 | 600.0 | 66.7% |" in md
    assert "`rms\\|norm`" in md                                  # a pipe in a name does not break the table


def test_markdown_of_a_cpu_run_says_there_are_no_gpu_kernels():
    md = render_markdown("cpu", {}, summarize([rng("decode", 0, 5)], wall_s=0.5))
    assert "no GPU kernels in the trace" in md and "No kernels recorded" in md and "GPU idle" not in md


def test_write_report_writes_markdown_and_json_beside_it(tmp_path):
    s = synthetic_summary()
    md, js = write_report(tmp_path / "sub" / "p.md", [("a", {"B": 1}, s), ("b", {"B": 2}, s)])
    assert js == tmp_path / "sub" / "p.json"
    text = md.read_text()
    assert text.count("\n## ") == 2 and "## a" in text and "## b" in text
    doc = json.loads(js.read_text())
    assert [x["title"] for x in doc["sections"]] == ["a", "b"]
    assert doc["sections"][1]["params"] == {"B": 2}
    assert doc["sections"][0]["summary"]["top_kernels"][0]["short_name"] == "gemm<float>"
    with pytest.raises(ValueError, match="p.txt"):
        write_report(tmp_path / "p.txt", [])


class FakeRunner:
    def decode(self, plan, *, extra=0):
        return torch.ones(3).add(plan + extra)

    def prefill(self, loop):
        return loop * 2


def test_annotate_runner_ranges_the_instance_only_and_restores_it(tmp_path):
    runner, other = FakeRunner(), FakeRunner()
    with annotate_runner(runner):
        assert "decode" in vars(runner) and "decode" not in vars(other)

        def work():
            return [runner.decode(1, extra=2), runner.decode(2), runner.prefill(3)]
        out, events = profile_call(work, tmp_path / "trace.json")
    assert "decode" not in vars(runner) and "prefill" not in vars(runner)
    assert out[0].tolist() == [4.0, 4.0, 4.0] and out[2] == 6
    s = summarize(events, wall_s=0.01)
    assert (s.part("decode").ranges, s.part("prefill").ranges, s.num_kernels) == (2, 1, 0)


@pytest.mark.gpu
def test_cuda_graph_replay_kernels_are_attributed_to_the_range_that_launched_them(tmp_path):
    """The trace facts summarize relies on, on a real CUDA trace: a graph replay's kernels are kernel events
    correlated with the cudaGraphLaunch inside the range; an eager launch inside the other range is its own."""
    x = torch.zeros(1 << 16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 2 + 1                                            # warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2 + 1                                            # two kernels per replay

    class Runner:
        def decode(self):
            graph.replay()

        def prefill(self):
            return x + 3

    runner = Runner()
    torch.cuda.synchronize()
    with annotate_runner(runner):
        def work():
            for _ in range(3):
                runner.decode()
            runner.prefill()
            torch.cuda.synchronize()
        _, events = profile_call(work, tmp_path / "trace.json")
    s = summarize(events, wall_s=1.0)
    d, p = s.part("decode"), s.part("prefill")
    assert (s.graph_launches, s.graph_launches_without_kernels) == (3, 0), figure_lines(s)
    assert d.ranges == 3 and d.kernels >= 6 and d.kernels % 3 == 0, s
    assert p.ranges == 1 and p.kernels >= 1, s
    assert s.kernel_busy_s > 0 and 0.0 < s.idle_share < 1.0
    assert y.shape == x.shape


def test_idle_splits_into_gaps_inside_a_graph_launch_and_time_with_no_launch():
    # one graph replay (correlation 1): kernels [0,10] and [12,20] -> a 2 us gap inside the launch;
    # then nothing until a second replay (correlation 2) at [50,60]
    evs = [kernel(0, 10, 1), kernel(12, 8, 1), kernel(50, 10, 2)]
    s = summarize(evs, wall_s=100e-6)
    assert s.kernel_busy_s == pytest.approx(28e-6) and s.idle_share == pytest.approx(0.72)
    assert s.gaps_within_launches_s == pytest.approx(2e-6)
    assert s.idle_between_launches_share == pytest.approx(0.70)
    assert any("2.0% between the kernels of one launch, 70.0% with no launch" in line for line in figure_lines(s))
