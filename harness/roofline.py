"""Roofline accounting (bundle format 7): per measured run, the device time of one decode loop, the bytes
one decode loop must move, and that rate as a fraction of the session's copy ceiling.

A decode loop is one ``Runner.decode`` call: one recurrent-core loop (``OuroModel.run_loop``: every layer,
the final norm and the exit gate) over the step's decode rows, each at its own depth, then ``lm_head`` and
greedy sampling over all of them (runtime/runner.py ``decode_core``); an engine step runs at most one, so
a run's decode loops are its ``work.decode_steps``. Per run, with L layers, h = hidden, H / Hkv heads,
D = head_dim, I = intermediate, V = vocab, b = bytes of the model dtype, kv = 2 Hkv D b (one token's K
and V in one layer), and the sums over the run's decode rows (a row = one token at one depth):

- weights  = loops x b (L (h (H + 2 Hkv) D + H D h + 2 I h + I h + 4 h) + 2 h): every layer's qkv, o,
  gate_up, down and four norms, the final norm and the gate's weight row (``OuroModel.weight_bytes``; its
  one-element bias left out), read each loop;
- lm_head  = loops x V h b: it runs on every decode loop over all its rows, also where none exits;
- KV read  = L kv x context_keys (a row computing output token j >= 1 of a request with a T-token prompt
  sits at position T + j - 1 and reads its T + j keys, once per loop the token ran: its exit depth)
  + L x 4 x ``coverage.routed_reads`` (the alias reader's int32 exit-map entries, per key it resolves)
  + L kv x fill sources (native: each decode token exiting below max_loops is read once by the fill);
- KV write = L kv x (decode rows + ``coverage.fill_token_planes``) (each row's own K / V; the native
  fill's copies) + 4 x decode tokens for alias layouts (one exit-map entry published per exit).

Not counted, as traffic that could stay on chip or in L2: embedding rows, descriptors, the activations between
the loop's kernels, logits, split-KV attention partials. The activations are not small (qkv, o_proj's and down's
fp32 split-K partials, the SwiGLU output...: about 211 kB per row and layer at the Ouro shape, 81 MB a loop at
B16, 2.5% of the counted bytes; 162 MB, 4.4%, at B32), nor are logits where lm_head writes them (2 N V b on more
than 32 rows); audit/FORMAT.md, Roofline, says what each is and why it is left out. Per loop
= total / loops; the device time is the sum of the record's ``decode_timing.loop_s``
(harness/loop_timing.py); achieved GB/s = bytes / time; the fraction = achieved / the ceiling
``bytes_per_copy / min(times_s)`` of the record's session (``ceilings/<session>.json``). The auditor
re-derives every figure with its own code (audit/check_roofline.py).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
EXIT_MAP_ENTRY_BYTES = 4      # runtime/kv_cache.py exit_map: int32


def loop_weight_bytes(mc: dict, b: int) -> int:
    """Weights one recurrent-core loop reads (``OuroModel.weight_bytes``) from the HF config ``mc``."""
    h, q, kv = mc["hidden_size"], mc["num_attention_heads"] * mc["head_dim"], mc["num_key_value_heads"] * mc["head_dim"]
    i = mc["intermediate_size"]
    per_layer = h * (q + 2 * kv) + q * h + 2 * i * h + i * h + 4 * h
    return b * (mc["num_hidden_layers"] * per_layer + 2 * h)


def decode_rows_and_keys(outputs: dict, prompt_lens: dict[str, int]) -> tuple[int, int]:
    """(decode rows, context keys) of a run's ``outputs`` (request id -> token_ids, exit_depths): output
    token j >= 1 ran exit_depths[j] loops, each reading prompt_len + j keys."""
    rows = keys = 0
    for rid, out in outputs.items():
        for j, depth in enumerate(out["exit_depths"][1:], start=1):
            rows += depth
            keys += depth * (prompt_lens[rid] + j)
    return rows, keys


def run_bytes(mc: dict, b: int, max_loops: int, rec: dict, prompt_lens: dict[str, int]) -> dict:
    """The module docstring's byte counts of one record's measured run, and its loops, rows and keys."""
    meas, layers = rec["measured"], mc["num_hidden_layers"]
    kv = 2 * mc["num_key_value_heads"] * mc["head_dim"] * b
    loops = meas["work"]["decode_steps"]
    rows, keys = decode_rows_and_keys(meas["outputs"], prompt_lens)
    depths = [d for out in meas["outputs"].values() for d in out["exit_depths"][1:]]
    alias = rec["arm_config"]["kv_layout"] != "native"
    top = min(max_loops, mc["total_ut_steps"])
    fill_sources = 0 if alias else sum(1 for d in depths if d < top)
    cov = rec["coverage"]
    return {"decode_loops": loops, "decode_rows": rows, "context_keys": keys,
            "weight_bytes": loops * loop_weight_bytes(mc, b),
            "lm_head_bytes": loops * mc["vocab_size"] * mc["hidden_size"] * b,
            "kv_read_bytes": layers * (kv * (keys + fill_sources) + EXIT_MAP_ENTRY_BYTES * cov["routed_reads"]),
            "kv_write_bytes": layers * kv * (rows + cov["fill_token_planes"]) + (EXIT_MAP_ENTRY_BYTES * len(depths) if alias else 0)}


def ceiling_gb_per_s(doc: dict | None) -> float | None:
    return None if doc is None else doc["bytes_per_copy"] / min(doc["times_s"]) / 1e9


def _row(rec: dict, counts: dict, ceiling: float | None) -> dict:
    timing = rec.get("decode_timing")
    loops = counts["decode_loops"]
    total = sum(counts[k] for k in ("weight_bytes", "lm_head_bytes", "kv_read_bytes", "kv_write_bytes"))
    gpu_s = sum(timing["loop_s"]) if timing and loops and len(timing["loop_s"]) == loops else None
    gb_s = None if not gpu_s else total / gpu_s / 1e9
    return {"job": rec["job"], "seq": rec["seq"], "session": rec.get("session", rec["job"]),
            "device": rec["device"]["label"], "point": rec["point"], "arm": rec["arm"],
            "kv_layout": rec["arm_config"]["kv_layout"], "timing": timing["method"] if timing else None, **counts,
            "decode_gpu_s": gpu_s, "ms_per_loop": None if gpu_s is None else gpu_s / loops * 1e3,
            "mb_per_loop": total / loops / 1e6 if loops else None, "achieved_gb_per_s": gb_s,
            "ceiling_gb_per_s": ceiling,
            "ceiling_fraction": None if gb_s is None or ceiling is None else gb_s / ceiling}


def derive(plan: dict, prompts: list[list[int]], records: list[dict], ceilings: dict[str, dict]) -> list[dict]:
    """One roofline row per raw record (contract ``tables.roofline``), by (job, seq)."""
    mc, b = plan["checkpoint"]["model_config"], DTYPE_BYTES[plan["config"]["model"]["dtype"]]
    max_loops = plan["config"]["exit"]["max_loops"]
    lens = {pt["key"]: {r["request_id"]: len(prompts[r["prompt_index"]]) for r in pt["requests"]} for pt in plan["points"]}
    return [_row(rec, run_bytes(mc, b, max_loops, rec, lens[rec["point"]]),
                 ceiling_gb_per_s(ceilings.get(rec.get("session", rec["job"]))))
            for rec in sorted(records, key=lambda r: (r["job"], r["seq"]))]


def load_ceilings(bundle: Path) -> dict[str, dict]:
    """Session id -> its ``ceilings/<session>.json``."""
    return {p.stem: json.loads(p.read_text()) for p in sorted((Path(bundle) / "ceilings").glob("*.json"))}


# ------------------------------------------------------------------------------------------- report

def _median(values: list) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def report_lines(plan: dict, rows: list[dict], ceilings: dict[str, dict], R: dict, table, workload) -> list[str]:
    """The Roofline section: per (device, point, arm) in plan point order the medians over its runs, then
    each session's ceiling. ``R``: the contract's ``report``; ``table``: a markdown table renderer;
    ``workload``: ``(plan, point key) -> "P / D"``."""
    spec, na = R["roofline"], R["words"]["na"]

    def fmt(key: str, value) -> str:
        return na if value is None else spec[key].format(value)

    order = {p["key"]: i for i, p in enumerate(plan["points"])}
    points = {p["key"]: p for p in plan["points"]}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["device"], order[r["point"]], r["arm"]), []).append(r)
    body = []
    for (dev, _, arm), g in sorted(groups.items()):
        pt = points[g[0]["point"]]

        def per_loop(key: str) -> str:
            return fmt("mb", _median([r[key] / r["decode_loops"] / 1e6 if r["decode_loops"] else None for r in g]))

        body.append(spec["row"].format(
            device=R["device_names"].get(dev, dev), max_num_seqs=pt["max_num_seqs"], num_requests=pt["num_requests"],
            workload=workload(plan, pt["key"]), arm=arm, runs=len(g),
            ms=fmt("ms", _median([r["ms_per_loop"] for r in g])), weights=per_loop("weight_bytes"),
            lm_head=per_loop("lm_head_bytes"), kv_read=per_loop("kv_read_bytes"), kv_write=per_loop("kv_write_bytes"),
            total=fmt("mb", _median([r["mb_per_loop"] for r in g])), gb_s=fmt("gb_s", _median([r["achieved_gb_per_s"] for r in g])),
            ceiling=fmt("gb_s", _median([r["ceiling_gb_per_s"] for r in g])),
            fraction=fmt("fraction", _median([r["ceiling_fraction"] for r in g]))))
    sessions = [spec["ceiling_row"].format(session=sid, device=R["device_names"].get(c["device"], c["device"]),
                                           mib=spec["mib"].format(c["buffer_bytes"] / 2**20),
                                           copies=len(c["times_s"]), best_ms=spec["ms"].format(min(c["times_s"]) * 1e3),
                                           gb_s=spec["gb_s"].format(ceiling_gb_per_s(c)))
                for sid, c in sorted(ceilings.items())]
    return (["", R["headings"]["roofline"], "", spec["text"], ""] + table(spec["columns"], body)
            + ["", spec["ceiling_text"], ""] + table(spec["ceiling_columns"], sessions))
