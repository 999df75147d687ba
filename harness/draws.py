"""The plan's seeded draws by the contract's SHA-256 rules (bundle format 15): the balanced pair order's
permutation (``documents.plan.order_rule``) and the synthetic prompts (``documents.plan.prompt_rule``).

numpy promises a Generator's stream only on the same build, environment and machine
(https://numpy.org/devdocs/reference/random/compatibility.html), so an order or prompt pool drawn from
``numpy.random.default_rng`` could differ on another numpy: an auditor there could name a sound order, and the same
config would measure other prompts. These rules hash a message per index instead, which no library version
changes; the auditor (audit/check_plan.py) implements them again from the contract's text. This module knows
nothing of arms, points or the pool's layout: :func:`stats.balanced_first` and harness/workloads.py say what is
drawn with which seed.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence

from .fileio import bundle_format

_PLAN = bundle_format()["documents"]["plan"]
ORDER_MESSAGE = _PLAN["order_message"]
PROMPT_MESSAGE = _PLAN["prompt_message"]
_WORDS = struct.Struct(">8I")   # a SHA-256 digest as 8 big-endian unsigned 32-bit words


def seed_text(seed: Sequence[int]) -> str:
    """The rules' spelling of a seed of several integers: decimal, joined by ',' (``[0, 80]`` -> ``"0,80"``)."""
    return ",".join(str(int(s)) for s in seed)


def permutation(n: int, seed: Sequence[int]) -> list[int]:
    """0 .. n - 1 sorted by the SHA-256 digest of ``order_message`` for each index (a tie, never seen, by index)."""
    text = seed_text(seed)
    digests = [hashlib.sha256(ORDER_MESSAGE.format(seed=text, index=i).encode("utf-8")).digest() for i in range(n)]
    return sorted(range(n), key=lambda i: (digests[i], i))


def prompt_tokens(seed: Sequence[int], index: int, length: int, vocab_size: int) -> list[int]:
    """Prompt ``index`` of the stream seeded ``seed``: its first ``length`` token ids in [0, vocab_size).

    Each digest of ``prompt_message`` (block 0, 1, ...) gives 8 words; a word below the largest multiple of
    vocab_size under 2**32 is the token ``word % vocab_size``, any other is skipped, so every id is equally likely
    (at most vocab_size / 2**32 of the words are skipped: about 1 in 28,000 for a 151,936-token vocabulary)."""
    if not 0 < vocab_size < 2 ** 32:
        raise ValueError(f"vocab_size must be in [1, 2**32), got {vocab_size!r}")
    limit = 2 ** 32 - 2 ** 32 % vocab_size
    text, tokens, block = seed_text(seed), [], 0
    while len(tokens) < length:
        digest = hashlib.sha256(PROMPT_MESSAGE.format(seed=text, index=index, block=block).encode("utf-8")).digest()
        tokens += [w % vocab_size for w in _WORDS.unpack(digest) if w < limit]
        block += 1
    return tokens[:length]
