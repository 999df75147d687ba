"""The Ouro looped decoder: configuration, presets, weights and the per-loop math.

Architecture (BRIEF section 1; Ouro, arXiv 2510.25741; tensor names as in the official HF checkpoint):
the same ``num_hidden_layers`` decoder layers run up to ``total_ut_steps`` times ("loops", "depths") per
token. Each layer is a sandwich-norm block::

    h = x + input_layernorm_2(attn(input_layernorm(x)))
    h = h + post_attention_layernorm_2(mlp(post_attention_layernorm(h)))

After the layers of each loop the final ``norm`` is applied; that normed state feeds the next loop, the
exit gate ``early_exit_gate`` (Linear(hidden, 1, bias=True)) and, at exit, ``lm_head``.

This module knows nothing about batching, paging or exit policies: attention is a callable handed in by
the caller (the engine or the naive reference), so one set of layer math serves both.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class OuroConfig:
    """The HF ``config.json`` keys the runtime uses (names as in the official Ouro checkpoint)."""

    hidden_size: int = 2048
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 128
    intermediate_size: int = 5632
    vocab_size: int = 49152
    max_position_embeddings: int = 65536
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    total_ut_steps: int = 4
    early_exit_threshold: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int):
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ValueError(f"config key {f.name!r} must be a positive integer, got {value!r}")
            elif f.type in ("float", float):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"config key {f.name!r} must be a finite number, got {value!r}")
            elif f.type in ("bool", bool) and not isinstance(value, bool):
                raise ValueError(f"config key {f.name!r} must be true or false, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(f"rms_norm_eps and rope_theta must be > 0, got {self.rms_norm_eps}, {self.rope_theta}")
        if not 0.0 < self.early_exit_threshold <= 1.0:
            raise ValueError(f"early_exit_threshold must be in (0, 1], got {self.early_exit_threshold}")

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, OuroConfig] = {
    # The exact Ouro-1.4B shape: 1,434,652,673 parameters.
    "ouro-1.4b": OuroConfig(),
    # Small enough that a whole paired benchmark runs in seconds on 2 CPU cores.
    "tiny": OuroConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       head_dim=16, intermediate_size=128, vocab_size=256, max_position_embeddings=1024,
                       rope_theta=10_000.0, total_ut_steps=4),
}


def tensor_shapes(cfg: OuroConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an HF-layout Ouro checkpoint, name -> shape (the loader validates against this)."""
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "self_attn.q_proj.weight": (nh * hd, h),
            p + "self_attn.k_proj.weight": (nkv * hd, h),
            p + "self_attn.v_proj.weight": (nkv * hd, h),
            p + "self_attn.o_proj.weight": (h, nh * hd),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "input_layernorm_2.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "post_attention_layernorm_2.weight": (h,),
        })
    shapes["model.norm.weight"] = (h,)
    shapes["model.early_exit_gate.weight"] = (1, h)
    shapes["model.early_exit_gate.bias"] = (1,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def parameter_count(cfg: OuroConfig) -> int:
    return sum(math.prod(s) for s in tensor_shapes(cfg).values())
