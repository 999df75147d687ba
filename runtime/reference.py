"""The naive reference generator: one request at a time, dense per-plane KV, plain Python loops.

It is slow and obvious on purpose, and shares with the engine only the model's weight tensors and the
small numeric primitives (RMSNorm, rotary tables). No batching, no paging, no fused projections, no
vectorised exit rule. LAST_EXITED (BRIEF section 1): a query at depth d reads earlier position q from
plane ``min(d, e_q)``; prompt positions exit at ``max_loops``; the exit rule is written out per token.
Tests hold the engine to it token for token and exit for exit.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .model import OuroConfig, apply_rope, rms_norm, rope_tables


class NaiveOuro:
    """Per-request Ouro generation from an HF-layout tensor dict."""

    def __init__(self, cfg: OuroConfig, tensors: dict[str, torch.Tensor], *, dtype=torch.float64, device="cpu"):
        self.cfg = cfg
        self.w = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
        self.acc = torch.promote_types(dtype, torch.float32)
        self.cos, self.sin = rope_tables(cfg, cfg.max_position_embeddings, device, self.acc)

    def _loop(self, x, positions, kv_plane, reads):
        """One loop for rows ``x`` [T, hidden] at ``positions``; fresh K/V go into ``kv_plane[layer]``
        (a dict position -> (k, v)); ``reads(layer, p)`` gives the key positions' (k, v) for row p."""
        cfg, w = self.cfg, self.w
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = self.cos[positions], self.sin[positions]
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            q = apply_rope(F.linear(h, w[p + "self_attn.q_proj.weight"]).view(-1, H, D), cos, sin)
            k = apply_rope(F.linear(h, w[p + "self_attn.k_proj.weight"]).view(-1, Hkv, D), cos, sin)
            v = F.linear(h, w[p + "self_attn.v_proj.weight"]).view(-1, Hkv, D)
            for j, pos in enumerate(positions.tolist()):
                kv_plane[i][pos] = (k[j], v[j])
            outs = []
            for j, pos in enumerate(positions.tolist()):
                keys, vals = zip(*reads(i, pos))
                K = torch.stack(keys).to(self.acc)                         # [ctx, Hkv, D]
                V = torch.stack(vals).to(self.acc)
                K = K.repeat_interleave(H // Hkv, dim=1)
                V = V.repeat_interleave(H // Hkv, dim=1)
                s = torch.einsum("hd,khd->hk", q[j].to(self.acc), K) / math.sqrt(D)
                outs.append(torch.einsum("hk,khd->hd", torch.softmax(s, dim=-1), V).to(x.dtype))
            a = torch.stack(outs).reshape(-1, H * D)
            x = x + rms_norm(F.linear(a, w[p + "self_attn.o_proj.weight"]), w[p + "input_layernorm_2.weight"],
                             cfg.rms_norm_eps)
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            m = F.linear(F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"])) * F.linear(h, w[p + "mlp.up_proj.weight"]),
                         w[p + "mlp.down_proj.weight"])
            x = x + rms_norm(m, w[p + "post_attention_layernorm_2.weight"], cfg.rms_norm_eps)
        return rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps)

    def _hazard(self, x) -> float:
        logit = F.linear(x, self.w["model.early_exit_gate.weight"], self.w["model.early_exit_gate.bias"])
        return float(torch.sigmoid(logit.to(self.acc)).reshape(()))

    def _token(self, x) -> int:
        head = self.w["model.embed_tokens.weight"] if self.cfg.tie_word_embeddings else self.w["lm_head.weight"]
        return int(F.linear(x.reshape(1, -1), head).argmax(-1))

    def generate(self, prompt: list[int], max_tokens: int, *, policy: str = "fixed", min_loops: int = 1,
                 max_loops: int = 4, threshold: float = 1.0, forced_exits: list[int] | None = None,
                 eos_token_id: int | None = None) -> tuple[list[int], list[int]]:
        """Greedy generation. Returns (output token ids, exit depth of each output token)."""
        L = self.cfg.num_hidden_layers
        planes = {d: [dict() for _ in range(L)] for d in range(1, max_loops + 1)}   # depth -> layer -> pos -> kv
        T = len(prompt)
        x = self.w["model.embed_tokens.weight"][torch.tensor(prompt)]
        positions = torch.arange(T)
        for d in range(1, max_loops + 1):
            x = self._loop(x, positions, planes[d], lambda i, p, d=d: [planes[d][i][q] for q in range(p + 1)])
        exits_of = [max_loops] * T           # e_q per position
        tokens, exit_depths = [self._token(x[-1])], [max_loops]
        while len(tokens) < max_tokens and not (eos_token_id is not None and tokens[-1] == eos_token_id):
            p = len(exits_of)
            x = self.w["model.embed_tokens.weight"][tokens[-1]].reshape(1, -1)
            survival, triggered, d = 1.0, False, 0
            while True:
                d += 1
                reads = lambda i, pos, d=d: [planes[min(d, exits_of[q]) if q < pos else d][i][q] for q in range(pos + 1)]
                x = self._loop(x, torch.tensor([p]), planes[d], reads)
                survival *= 1.0 - self._hazard(x)
                test = threshold < 1.0 and d >= min_loops and 1.0 - survival >= threshold
                if policy == "replay":
                    stop = d == forced_exits[len(tokens)]
                elif policy == "fixed":
                    stop = d >= max_loops
                elif policy == "ouro":
                    stop = d >= max_loops or test
                elif policy == "ouro_delayed":
                    stop = d >= max_loops or triggered
                    triggered = triggered or test
                else:
                    raise ValueError(f"unknown policy {policy!r}")
                if stop:
                    break
            exits_of.append(d)
            tokens.append(self._token(x))
            exit_depths.append(d)
        return tokens, exit_depths
