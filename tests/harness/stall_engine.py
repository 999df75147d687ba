"""A test engine that stalls: ``LoopEngine`` until this process has built it once, then its ``run`` sleeps.

An arm with ``engine: "tests.harness.stall_engine:make_engine"`` measures normally in its first pair and
hangs in its second, so that a session is mid-run, with completed arms on disk, for as long as a fault
test needs (an ``scancel``, a time limit, a node taken down); nothing in it ever ends the sleep.
"""
import time

from loopbench.runtime.engine import LoopEngine

_built = 0


class _Stalling(LoopEngine):
    def run(self):
        time.sleep(3600)
        return super().run()


def make_engine(model, config):
    global _built
    _built += 1
    return LoopEngine(model, config) if _built == 1 else _Stalling(model, config)
