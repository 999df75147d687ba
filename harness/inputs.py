"""What a plan is made of, gathered before the bundle exists: the model's config, the prompt pool, the
devices, the code's identity; then the checkpoint itself (a synthetic one is written once, then reused).

A value the model or the devices cannot take fails here (ValueError naming the key), before anything is
written or measured.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from . import conf, draws, engines, machine, rules, workloads
from .fileio import sha256_bytes
from .identity import code_identity
from .spec import BenchSpec, check_fits_model


@dataclass(frozen=True)
class Inputs:
    """The prompt pool (and its JSON text, ``prompts.json``), positions, devices, code identity, cache."""

    prompts: list[list[int]]
    prompts_text: str
    max_model_len: int
    devices: list[dict]     # machine.planned_devices
    code: dict              # identity.code_identity, with engine_sources where an arm runs an external engine
    cache: Path

    @property
    def prompts_sha256(self) -> str:
        return sha256_bytes(self.prompts_text.encode())


def gather(spec: BenchSpec) -> Inputs:
    """Model config, prompts, devices and code identity; ValueError when the model or devices cannot take
    the config."""
    model_cfg = model_config(spec)
    prompts = make_prompts(spec, model_cfg["vocab_size"])
    longest = max((len(p) for p in prompts), default=0)
    check_fits_model(spec, model_cfg, longest)
    workloads.check_points_fit(spec, model_cfg["max_position_embeddings"], longest)
    prompts += workloads.point_prompts(spec, model_cfg["vocab_size"])   # points' own prompt lengths, after the pool
    check_folders(spec)
    devices = machine.planned_devices(spec.executor)
    if all(d["kind"] == "cpu" for d in devices):
        for name, arm in spec.arms.items():
            if arm.attention_backend == "triton":
                raise ValueError(f"arms.{name}.attention_backend = triton would run under the Triton interpreter, since "
                                 f"the sessions would run on the CPU (executor.device = {spec.executor.device}): "
                                 "its timings would be the interpreter's (about 1 tok/s), not a kernel's; use a CUDA "
                                 f"host, or arms.{name}.attention_backend=torch")
            if arm.cuda_graphs:
                raise ValueError(f"arms.{name}.cuda_graphs = true needs a CUDA device, but the sessions would run "
                                 f"on the CPU (executor.device = {spec.executor.device}); use a CUDA host, "
                                 f"--config-name cpu-smoke, or arms.{name}.cuda_graphs=false")
    code = code_identity()
    sources = engines.engine_sources(spec.arms)     # an external engine's sources: code_sha256 covers only ours
    if sources:
        code["engine_sources"] = sources
    return Inputs(prompts=prompts, prompts_text=json.dumps(prompts, separators=(",", ":")) + "\n",
                  max_model_len=workloads.longest_request(spec, longest), devices=devices,
                  code=code, cache=conf.cache_dir(spec))


def results_path(spec: BenchSpec) -> Path:
    """``results_dir`` as bench writes into it: a relative one is below the repository, whatever the cwd."""
    from .executors import REPO_ROOT

    results = Path(spec.results_dir).expanduser()
    return results if results.is_absolute() else REPO_ROOT / results


def check_folders(spec: BenchSpec) -> None:
    """The results and cache folders can be made (``rules.check_folder``): ValueError naming the key (or
    ``$LOOPBENCH_CACHE``, where the cache folder comes from it) before anything is written."""
    if not spec.results_dir.strip():   # '' resolved to the repository root, where the bundle folders then landed
        raise ValueError(f"results_dir must name a folder, got {spec.results_dir!r} (the default is 'results')")
    rules.check_folder("results_dir", spec.results_dir, results_path(spec))
    if spec.cache_dir is not None and not spec.cache_dir.strip():   # '' fell back to the default cache unsaid
        raise ValueError(f"cache_dir must name a folder, got {spec.cache_dir!r} (null, the default, is "
                         "$LOOPBENCH_CACHE or ~/.cache/loopbench)")
    source = cache_source(spec)
    if source:
        rules.check_folder(*source, conf.cache_dir(spec))


def cache_source(spec: BenchSpec) -> tuple[str, str] | None:
    """Where the cache folder comes from, as (key, value written): ``cache_dir``, else ``$LOOPBENCH_CACHE``; None
    for the default folder."""
    env = os.environ.get("LOOPBENCH_CACHE")
    return ("cache_dir", spec.cache_dir) if spec.cache_dir else ("$LOOPBENCH_CACHE", env) if env else None


def checkpoint_path(spec: BenchSpec) -> Path | None:
    """``model.checkpoint`` resolved, or None for a preset; ValueError when it is no HF checkpoint."""
    from loopbench.runtime.checkpoint import CONFIG_NAME

    if spec.model.checkpoint is None:
        return None
    if not spec.model.checkpoint.strip():   # '' measured the preset's synthetic checkpoint in place of the real one
        raise ValueError(f"model.checkpoint must name an HF checkpoint directory, got {spec.model.checkpoint!r} (null, "
                         "the default, is the preset's synthetic checkpoint)")
    path = Path(spec.model.checkpoint).expanduser().resolve()
    if not (path / CONFIG_NAME).is_file():
        raise ValueError(f"model.checkpoint = {spec.model.checkpoint!r} is not an HF checkpoint directory "
                         f"(no {CONFIG_NAME})")
    return path


def _preset(spec: BenchSpec):
    from loopbench.runtime.model import PRESETS

    if spec.model.preset not in PRESETS:
        raise ValueError(f"model.preset = {spec.model.preset!r} is not a preset; known: {sorted(PRESETS)}")
    return PRESETS[spec.model.preset]


def model_config(spec: BenchSpec) -> dict:
    """The model's ``config.json`` keys (vocab, loops, positions) before anything is written: the preset's
    table entry, or a real checkpoint's own ``config.json``."""
    from loopbench.runtime.checkpoint import CONFIG_NAME, config_from_hf_dict

    path = checkpoint_path(spec)
    if path is None:
        return _preset(spec).to_dict()
    file = path / CONFIG_NAME
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:   # json's own words named neither the file nor the key
        raise ValueError(f"model.checkpoint = {spec.model.checkpoint!r}: {file} is not readable JSON ({exc})") from None
    try:
        return config_from_hf_dict(raw, source=str(file)).to_dict()
    except ValueError as exc:
        raise ValueError(f"model.checkpoint = {spec.model.checkpoint!r}: {exc}") from None


def synthetic_checkpoint_path(spec: BenchSpec, cache: Path) -> Path:
    """Where the preset's calibrated synthetic checkpoint lives in the cache (written or not)."""
    m = spec.model
    _preset(spec)
    return cache / "checkpoints" / f"{m.preset}-seed{m.seed}-{m.dtype}-calibrated"


def _synthetic_checkpoint(spec: BenchSpec, cache: Path) -> Path:
    """The preset's calibrated synthetic checkpoint in the cache, written once (atomically, by rename)."""
    from loopbench.runtime.checkpoint import CONFIG_NAME

    from .fixtures import write_calibrated_checkpoint
    from .session import TORCH_DTYPES

    m = spec.model
    path = synthetic_checkpoint_path(spec, cache)
    if not (path / CONFIG_NAME).is_file():
        import torch

        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            # the exit-gate bias is calibrated on the model's own loop-1/2 states (harness/fixtures.py)
            write_calibrated_checkpoint(tmp, m.preset, seed=m.seed, dtype=TORCH_DTYPES[m.dtype],
                                        device="cuda" if torch.cuda.is_available() else "cpu")
            try:
                tmp.rename(path)  # atomic: a half-written checkpoint is never found under the final name
            except OSError:       # another run wrote it first (the same seeded preset): use theirs
                if not (path / CONFIG_NAME).is_file():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:   # also a stop (KeyboardInterrupt): no half-written copy left in the cache
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if torch.cuda.is_available():  # give the calibration's memory back before any session starts
            torch.cuda.empty_cache()
    return path


def prepare_checkpoint(spec: BenchSpec, cache: Path) -> dict:
    """The plan's ``checkpoint`` entry: directory, sha256 (of the stored bytes), model config and stored
    dtypes; a synthetic one is written once, then reused.

    ``stored_dtypes`` is ``checkpoint.dtype_record``: HF dtype name -> tensor names as stored, before the
    sessions cast every tensor to ``model.dtype``; reading it validates every tensor header (names,
    shapes, floating dtypes), so a broken checkpoint fails here, before anything is measured.
    """
    from loopbench.runtime.checkpoint import (CONFIG_NAME, checkpoint_sha256, config_from_hf_dict, dtype_record,
                                              stored_dtypes)

    m = spec.model
    path = checkpoint_path(spec)
    if path is not None:
        source, description = "path", f"checkpoint {path}"
    else:
        path = _synthetic_checkpoint(spec, cache)
        source, description = "synthetic", f"synthetic `{m.preset}` (seed {m.seed})"
    cfg = config_from_hf_dict(json.loads((path / CONFIG_NAME).read_text()))
    return {"source": source, "path": str(path), "preset": None if m.checkpoint else m.preset,
            "description": description, "sha256": checkpoint_sha256(path), "model_config": cfg.to_dict(),
            "stored_dtypes": dtype_record(stored_dtypes(path))}


def read_prompts_file(path: Path) -> list[list[int]]:
    """Token-id prompts from parquet (a ``prompt_token_ids`` list column) or JSONL (a list, or an object
    with ``prompt_token_ids``, per line). ValueError names ``workload.prompts_file``, the file and, in JSONL, the
    line: a file that is not parquet, a line that is not JSON, an item that is not a non-empty list of int ids."""
    if path.suffix == ".parquet":
        import pandas as pd
        import pyarrow

        try:
            df = pd.read_parquet(path)
        except (OSError, pyarrow.ArrowException) as exc:
            raise ValueError(f"workload.prompts_file {path}: not a readable parquet file ({exc})") from None
        if "prompt_token_ids" not in df.columns:
            raise ValueError(f"workload.prompts_file {path}: no 'prompt_token_ids' column (columns: "
                             f"{list(df.columns)})")
        return [[int(t) for t in row] for row in df["prompt_token_ids"]]
    prompts = []
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"workload.prompts_file {path}: not a text file (JSONL, one prompt a line) and not named "
                         "*.parquet") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"workload.prompts_file {path}:{n}: not JSON ({exc.msg} at column {exc.colno}); each "
                             "line holds a list of token ids or an object with prompt_token_ids") from None
        ids = item.get("prompt_token_ids") if isinstance(item, dict) else item
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"workload.prompts_file {path}:{n}: expected a non-empty list of token ids, got "
                             f"{str(item)[:80]!r}")
        prompts.append(ids)
    return prompts


def make_prompts(spec: BenchSpec, vocab_size: int) -> list[list[int]]:
    """The prompt pool: seeded uniform token ids, or the user's file.

    Prompt i has ``prompt_lens[i % len(prompt_lens)]`` tokens (``prompt_len`` where prompt_lens is null), the
    first of its own stream seeded ``prompt_seed`` (the contract's ``documents.plan.prompt_rule``, format 15:
    SHA-256 words by rejection, :func:`draws.prompt_tokens`; formats up to 14 drew the pool from numpy's
    ``default_rng(prompt_seed)``, whose stream numpy does not promise across its versions, so the same config
    measured other prompts on another numpy).
    """
    wl = spec.workload
    need = workloads.workload_requests(spec)   # the points without a prompt_len of their own
    if wl.prompts_file:
        prompts = read_prompts_file(Path(wl.prompts_file).expanduser())
        if len(prompts) < need:
            raise ValueError(f"workload.prompts_file has {len(prompts)} prompts; the largest point needs {need}")
        bad = [(i, t) for i, p in enumerate(prompts) for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"workload.prompts_file: prompt {bad[0][0]} has token id {bad[0][1]} outside "
                             f"[0, {vocab_size})")
        return prompts[:need]
    lens = wl.prompt_lens or (wl.prompt_len,)
    return [draws.prompt_tokens([wl.prompt_seed], i, lens[i % len(lens)], vocab_size) for i in range(need)]
