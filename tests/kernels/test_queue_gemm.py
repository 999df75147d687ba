"""kernels/bench/queue_gemm.py on the interpreter: looping programs, static or from the work queue, give the
pointer kernel's bits (plain and SwiGLU, split-K partials, tiles crossing N and K edges), launch after launch."""
import pytest
import torch

from loopbench.kernels import gemm as gm
from loopbench.kernels.bench import queue_gemm as qg


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("glu, split", [(False, 1), (False, 2), (True, 1)])     # SwiGLU needs the whole sum
def test_queue_gemm_is_the_pointer_kernel_bitwise(glu, dynamic, split):
    g = torch.Generator().manual_seed(0)
    n, k, m = 80, 200, 3            # 3 column tiles of 32 (the last partial), 4 K tiles of 64 (the last partial)
    w = torch.randn((2 * n if glu else n, k), generator=g).to(torch.bfloat16)
    x = torch.randn((m, k), generator=g).to(torch.bfloat16)
    cfg = gm.GemmConfig(block_n=32, block_k=64, split_k=split)
    ref = gm.gemm_swiglu(x, w, cfg) if glu else gm.gemm(x, w, cfg)
    queue = torch.zeros(1, dtype=torch.int32)
    tiles = 3 * split
    for launch in range(2):          # the queue starts at tile 0 again without a reset
        out = qg.queue_gemm(x, w, cfg, queue, programs=2, dynamic=dynamic, glu=glu)
        assert torch.equal(out, ref)
        assert queue.item() == ((launch + 1) * (tiles + 2) if dynamic else 0)
