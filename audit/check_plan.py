"""Checks of the frozen plan: its hashes, each point's request list (the prompt of every request), the
frozen references against the prompts, the seeded prompt pool (format 15), and the seeded balanced measurement
order of the records.

The seeded draws follow the contract's rules of the bundle's version: from format 15 ``documents.plan.order_rule``
and ``prompt_rule`` (SHA-256 of a message per index, re-implemented here from the contract's text), before it
``order_rule_before`` (numpy's Generator, as installed: numpy does not promise its stream across versions, so
an older bundle's order is re-derived as its writer drew it only on a numpy that draws the same)."""
from __future__ import annotations

import hashlib
import json
import math

import numpy as np

from . import contract
from .context import Audit
from .values import canonical, prompt_sha256, sha256_file

PLAN = contract.DOCS["plan"]


def point_requests(ctx: Audit, pt: dict) -> list[dict]:
    """The requests a plan point lists (format 2); a version-1 point lists none, and by its rule request
    r<i> is prompts[i] for the first C prompts."""
    if ctx.version < PLAN["point_requests_since"]:
        return [{"request_id": f"r{i:04d}", "prompt_index": i} for i in range(pt["num_requests"])]
    return pt["requests"]


def check_plan(ctx: Audit, plan: dict) -> None:
    """plan.json has the contract's fields; the config's, prompts' and references' sha256s are the ones it
    records."""
    closed = ctx.version >= contract.CLOSED_SINCE
    fields = contract.fields_at(PLAN["fields"], PLAN["fields_since"], ctx.version)
    optional = contract.fields_at(PLAN["optional"], PLAN["fields_since"], ctx.version)
    problem = contract.fields_problem(plan, fields, "plan.json: ", optional, closed=closed)
    if problem is not None:
        ctx.fail("plan", problem)
    for job, items in plan["order"].items():
        bad = (contract.fields_problem(o, PLAN["order_item_fields"], f"plan.json: order {job}: ", closed=closed)
               if isinstance(o, dict) else f"plan.json: order {job}: {o!r}" for o in items)
        problem = next((p for p in bad if p is not None), None)
        if problem is not None:
            ctx.fail("plan", problem)
    cfg_sha = hashlib.sha256(canonical(plan["config"])).hexdigest()
    if cfg_sha != plan["config_sha256"]:
        ctx.fail("plan", f"config sha256 is {cfg_sha}, plan.json says {plan['config_sha256']}")
    got = sha256_file(ctx.bundle / plan["prompts"]["file"])
    if got != plan["prompts"]["sha256"]:
        ctx.fail("plan", f"prompts sha256 is {got}, plan.json says {plan['prompts']['sha256']}")
    for pt in plan["points"]:
        ref = pt.get("reference")
        if not ref:  # an incomplete run may have failed to capture it; the summary check says so
            continue
        for f, want in ((ref["file"], ref["sha256"]), (ref["meta_file"], ref["meta_sha256"])):
            if (ctx.bundle / f).is_file() and sha256_file(ctx.bundle / f) != want:
                ctx.fail("plan", f"{f} sha256 is {sha256_file(ctx.bundle / f)}, plan.json says {want}")


def check_point_requests(ctx: Audit, plan: dict) -> None:
    """Each point has the contract's fields and lists C distinct requests, each on a prompt of the pool."""
    n_prompts = plan["prompts"].get("count")
    fields = {k: v for k, v in contract.fields_at(PLAN["point_fields"], PLAN["point_fields_since"], ctx.version).items()
              if k != "requests" or ctx.version >= PLAN["point_requests_since"]}
    closed = ctx.version >= contract.CLOSED_SINCE
    for pt in plan["points"]:
        where = f"point {pt.get('key')!r}: "
        problem = contract.fields_problem(pt, fields, where, PLAN["point_optional"], closed)
        if problem is None and isinstance(pt.get("reference"), dict):
            problem = contract.fields_problem(pt["reference"], PLAN["reference_fields"], f"{where}reference.",
                                              closed=closed)
        if problem is not None:
            ctx.fail("plan", problem)
            continue
        if ctx.version < PLAN["point_requests_since"] and "requests" in pt:   # a downgrade attack
            ctx.fail("plan", f"point {pt['key']} lists its requests, which format version {ctx.version} does not "
                             f"(they are version {PLAN['point_requests_since']} content)")
        reqs = point_requests(ctx, pt)
        problems = (contract.fields_problem(q, PLAN["point_request_fields"], "", closed=closed) if isinstance(q, dict)
                    else f"{q!r} is not an object" for q in reqs)
        bad = next((p for p in problems if p is not None), None)
        if bad is not None:
            ctx.fail("plan", f"point {pt['key']}: requests: {bad}")
            continue
        if len(reqs) != pt["num_requests"] or len({q["request_id"] for q in reqs}) != len(reqs):
            ctx.fail("plan", f"point {pt['key']} lists {len(reqs)} requests "
                             f"({len({q['request_id'] for q in reqs})} distinct ids) for C{pt['num_requests']}")
        indices = [q["prompt_index"] for q in reqs]
        for i in sorted({i for i in indices if indices.count(i) > 1}):
            ctx.fail("plan", f"point {pt['key']} lists prompt_index {i} for {indices.count(i)} requests; a point's "
                             "requests run distinct prompts")
        for q in reqs:
            if not 0 <= q["prompt_index"] < (n_prompts if n_prompts is not None else math.inf):
                ctx.fail("plan", f"point {pt['key']} request {q['request_id']}: prompt_index {q['prompt_index']} "
                                 f"is not in the pool of {n_prompts} prompts")
        _check_point_workload(ctx, plan, pt, reqs)


def point_output_len(plan: dict, pt: dict) -> int:
    """D of a point: its own (format 5 points carry it), else the workload's."""
    return pt.get("output_len", plan["config"]["workload"]["output_len"])


def _check_point_workload(ctx: Audit, plan: dict, pt: dict, reqs: list[dict]) -> None:
    """Format 5: a point's prompt_len and output_len are those of its config entry (same place in
    ``config.points``; a null output_len there is the workload's), and each of its requests' prompts has
    prompt_len tokens."""
    if ctx.version < max(PLAN["point_fields_since"].values()):
        return
    i = plan["points"].index(pt)
    conf = plan["config"]["points"][i] if i < len(plan["config"]["points"]) else {}
    want = (conf.get("prompt_len"), conf.get("output_len") or plan["config"]["workload"]["output_len"])
    if (pt["prompt_len"], pt["output_len"]) != want:
        ctx.fail("plan", f"point {pt['key']}: prompt_len {pt['prompt_len']!r} / output_len {pt['output_len']!r}, its "
                         f"config entry config.points[{i}] gives {want[0]!r} / {want[1]!r}")
    if pt["prompt_len"] is None:
        return
    prompts = json.loads((ctx.bundle / plan["prompts"]["file"]).read_text())
    for q in reqs:
        j = q["prompt_index"]
        if 0 <= j < len(prompts) and len(prompts[j]) != pt["prompt_len"]:
            ctx.fail("plan", f"point {pt['key']} request {q['request_id']}: prompts.json[{j}] has {len(prompts[j])} "
                             f"tokens, the point's prompt_len is {pt['prompt_len']}")


def check_prompts(ctx: Audit, plan: dict) -> None:
    """Format 15: a seeded pool (no ``workload.prompts_file``) is the one ``documents.plan.prompt_rule`` gives the
    plan's workload, points and vocabulary, prompt for prompt (formats up to 14 drew it from numpy and are not
    re-derived)."""
    wl = plan["config"]["workload"]
    if ctx.version < PLAN["prompt_rule_since"] or wl["prompts_file"]:
        return
    vocab = (plan["checkpoint"].get("model_config") or {}).get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 0 < vocab < 2 ** 32:
        ctx.fail("plan", f"plan.json checkpoint.model_config.vocab_size is {vocab!r}: the seeded prompts cannot be "
                         "re-derived (the contract's documents.plan.prompt_rule)")
        return
    want = seeded_pool(plan, vocab)
    got = json.loads((ctx.bundle / plan["prompts"]["file"]).read_text())
    wrong = [i for i in range(max(len(got), len(want))) if got[i:i + 1] != want[i:i + 1]]
    if wrong:
        ctx.fail("plan", f"prompts.json is not the seeded pool of the contract's documents.plan.prompt_rule: "
                         f"{len(wrong)} of its {len(got)} prompts differ from the rule's {len(want)}, the first "
                         f"prompts.json[{wrong[0]}]")
    ctx.count("seeded_prompts", len(want))


def seeded_pool(plan: dict, vocab: int) -> list[list[int]]:
    """The pool ``documents.plan.prompt_rule`` gives: the workload's prompts for the points without a prompt_len,
    then a block per distinct point prompt_len P, in point order, each as large as its largest point."""
    wl, points = plan["config"]["workload"], plan["points"]
    lens = wl["prompt_lens"] or [wl["prompt_len"]]
    own = max((pt["num_requests"] for pt in points if pt["prompt_len"] is None), default=0)
    pool = [_seeded_prompt(str(wl["prompt_seed"]), i, lens[i % len(lens)], vocab) for i in range(own)]
    for p in dict.fromkeys(pt["prompt_len"] for pt in points if pt["prompt_len"] is not None):
        block = max(pt["num_requests"] for pt in points if pt["prompt_len"] == p)
        pool += [_seeded_prompt(f"{wl['prompt_seed']},{p}", j, p, vocab) for j in range(block)]
    return pool


def _seeded_prompt(seed: str, index: int, length: int, vocab: int) -> list[int]:
    """One prompt of ``documents.plan.prompt_rule``: the accepted 32-bit words of its digests (block 0, 1, ...),
    each mod ``vocab``, the first ``length`` of them."""
    accept_below = 2 ** 32 - 2 ** 32 % vocab
    kept, block = np.empty(0, dtype=np.int64), 0
    while kept.size < length:
        blocks = range(block, block + -(-(length - kept.size) // 8))   # 8 words a digest
        digests = b"".join(hashlib.sha256(PLAN["prompt_message"].format(seed=seed, index=index, block=b)
                                          .encode("utf-8")).digest() for b in blocks)
        words = np.frombuffer(digests, dtype=">u4").astype(np.int64)
        kept = np.concatenate([kept, words[words < accept_below]])
        block = blocks.stop
    return (kept[:length] % vocab).tolist()


def check_references(ctx: Audit, plan: dict, refs: dict) -> None:
    """Every frozen reference runs exactly its point's requests, each on the prompt the plan gives it, for
    D tokens with exit depths in 1..max_loops."""
    cfg = plan["config"]
    prompts = json.loads((ctx.bundle / plan["prompts"]["file"]).read_text())
    ex = cfg["exit"]
    for pt in plan["points"]:
        D = point_output_len(plan, pt)
        sched = refs.get(pt["key"], {}).get("schedule")
        if sched is None:
            continue
        if sched["max_num_seqs"] != pt["max_num_seqs"] or len(sched["requests"]) != pt["num_requests"]:
            ctx.fail("reference", f"{pt['key']}: schedule has B{sched['max_num_seqs']}/C{len(sched['requests'])}")
        planned = {q["request_id"]: q["prompt_index"] for q in point_requests(ctx, pt)}
        for r in sched["requests"]:
            where = f"{pt['key']} request {r['request_id']}"
            i = planned.get(r["request_id"])
            if i is None:
                ctx.fail("reference", f"{where} is not a request of the plan's point")
            elif not 0 <= i < len(prompts) or r["prompt_sha256"] != prompt_sha256(prompts[i]):
                ctx.fail("reference", f"{where}: prompt sha256 does not match prompts.json[{i}], the plan's "
                                      "prompt_index")
            elif r["prompt_len"] != len(prompts[i]):
                ctx.fail("reference", f"{where}: prompt_len {r['prompt_len']} is not the {len(prompts[i])} tokens of "
                                      f"prompts.json[{i}], the plan's prompt_index")
            if len(r["token_ids"]) != D or len(r["exit_depths"]) != D:
                ctx.fail("reference", f"{where}: {len(r['token_ids'])} tokens, {len(r['exit_depths'])} depths, "
                                      f"expected {D}")
            if any(not 1 <= d <= ex["max_loops"] for d in r["exit_depths"]):
                ctx.fail("reference", f"{where}: exit depth outside 1..{ex['max_loops']}")
            ctx.count("reference_requests")


def first_arms(n: int, seed: list[int], version: int) -> list[str]:
    """Each of ``n`` pairs' first arm, ceil(n/2) baseline and floor(n/2) candidate, in the permutation seeded
    ``seed`` by the contract's rule of ``version``: ``documents.plan.order_rule`` (indices by their SHA-256
    digests of ``order_message``) or, before its ``order_rule_since``, ``order_rule_before`` (numpy)."""
    if version >= PLAN["order_rule_since"]:
        spelt = ",".join(map(str, seed))
        keyed = sorted((hashlib.sha256(PLAN["order_message"].format(seed=spelt, index=i).encode("utf-8")).digest(), i)
                       for i in range(n))
        perm = [i for _, i in keyed]
    else:
        perm = np.random.default_rng(seed).permutation(n).tolist()
    return ["baseline" if i < math.ceil(n / 2) else "candidate" for i in perm]


def order_rule(version: int) -> str:
    """The contract's name of the order rule a bundle of ``version`` follows, for a discrepancy to cite."""
    return "documents.plan.order_rule" if version >= PLAN["order_rule_since"] else "documents.plan.order_rule_before"


def balanced_order(plan: dict, version: int) -> list[dict]:
    """The seeded balanced order: restart after restart (format 4's ``sessions``; one before it), per
    point, pair i of every comparison, first arm ceil/floor balanced (:func:`first_arms`), seeded with the
    restart appended after the first; pair indices run on over restarts."""
    cfg = plan["config"]
    n, comps = cfg["pairs"], cfg["comparisons"]
    expected, seq = [], 0
    for restart in range(cfg.get("sessions", 1)):
        for pi, pt in enumerate(plan["points"]):
            firsts = [first_arms(n, [cfg["order_seed"], pi, ci] + ([restart] if restart else []), version)
                      for ci in range(len(comps))]
            for i in range(n):
                for ci, comp in enumerate(comps):
                    pos = ("baseline", "candidate") if firsts[ci][i] == "baseline" else ("candidate", "baseline")
                    for slot, p in enumerate(pos):
                        expected.append({"seq": seq, "point": pt["key"], "comparison": comp["name"],
                                         "pair": restart * n + i, "position": p, "slot": slot, "arm": comp[p]})
                        seq += 1
    return expected


def check_order(ctx: Audit, plan: dict, records: list[dict]) -> None:
    """plan.json's order is the seeded one; each record sits at its planned place with its planned arm,
    config and workload, and a device's records were measured in their order."""
    expected = balanced_order(plan, ctx.version)
    for dev in plan["devices"]:
        if plan["order"].get(dev["name"]) != expected:
            ctx.fail("order", f"{dev['name']}: plan.json's measurement order is not the seeded balanced order "
                              f"(the contract's {order_rule(ctx.version)})")
    if set(plan["order"]) != {d["name"] for d in plan["devices"]}:
        ctx.fail("order", f"plan.json orders sessions {sorted(plan['order'])}, its devices are "
                          f"{sorted(d['name'] for d in plan['devices'])}")
    by_seq = {(d["name"], it["seq"]): it for d in plan["devices"] for it in plan["order"].get(d["name"], [])}
    last: dict[str, tuple[int, float]] = {}
    for r in records:
        check_record_place(ctx, plan, r, by_seq.get((r["job"], r["seq"])))
        start = (r.get("wall_clock") or {}).get("measured_start_unix_s")
        prev = last.get(r["job"])
        if prev is not None and start is not None and start < prev[1]:
            ctx.fail("order", f"{r['job']} seq {r['seq']} was measured before seq {prev[0]}")
        if start is not None:
            last[r["job"]] = (r["seq"], start)
        ctx.count("records_in_order")


def check_record_place(ctx: Audit, plan: dict, r: dict, item: dict | None, kind: str = "order",
                       where: str | None = None) -> None:
    """Record ``r`` is planned ``item`` (its order item of its job and seq; None: none), with its arm's config and its
    point's workload; a discrepancy of ``kind`` names it ``where`` (by default ``record <job> seq <seq>``)."""
    cfg, where = plan["config"], where or f"record {r['job']} seq {r['seq']}"
    if item is None or any(r[f] != item[f] for f in PLAN["order_item_fields"] if f != "seq"):
        ctx.fail(kind, f"{where} ({r['arm']}) is not at its planned place")
    if r["arm_config"] != cfg["arms"].get(r["arm"]):
        ctx.fail(kind, f"{where}: arm {r['arm']!r} ran a config other than planned")
    pt = next((p for p in plan["points"] if p["key"] == r["point"]), {})
    planned = (pt.get("max_num_seqs"), pt.get("num_requests"), point_output_len(plan, pt))
    if (r["max_num_seqs"], r["num_requests"], r["output_len"]) != planned:
        ctx.fail(kind, f"{where}: B{r['max_num_seqs']}/C{r['num_requests']}/D{r['output_len']}, the plan "
                       f"says B{planned[0]}/C{planned[1]}/D{planned[2]}")
