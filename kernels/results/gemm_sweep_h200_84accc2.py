"""Exploration (not product): small-M GEMM variants vs cuBLAS on the H200, graph-chain timing.

Variants: swap-AB (weight tile is the MMA's M side, the batch its N side), pointer or TMA (host
TensorDescriptor) loads, split-K with fp32 partials, PDL on/off. Prints one line per config.
"""
import argparse, itertools, json, os, sys, time
import torch, triton, triton.language as tl
import torch.nn.functional as F
from concurrent.futures import ProcessPoolExecutor

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # noqa
    TensorDescriptor = None

SHAPES = {"qkv": (6144, 2048), "o_proj": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
          "lm_head": (49152, 2048)}
WS = 256 << 20


@triton.jit(do_not_specialize=["M"])
def swap_ptr(x_ptr, w_ptr, out_ptr, M, K, iters_per_split, stride_xm, stride_om, stride_ps,
             BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
             EARLY: tl.constexpr = False, PF: tl.constexpr = False):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    lo = s * iters_per_split
    n_it = tl.minimum(iters_per_split, tl.cdiv(K, BK) - lo)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + (lo * BK + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (lo * BK + offs_k)[:, None]
    mask_m = offs_m[None, :] < M
    acc = tl.zeros((BN, BM), tl.float32)
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    if PF:
        rows = pid_n * BN + tl.arange(0, BN)
        rp = w_ptr + rows.to(tl.int64) * K + lo * BK
        nb = tl.full([BN], 0, tl.int32) + n_it * BK * 2
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;", "=r,l,r",
                                  [rp, nb], dtype=tl.int32, is_pure=False, pack=1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    for i in range(n_it):
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs, mask=mask_m, other=0.0)
        acc = tl.dot(w, x, acc)
        w_ptrs += BK
        x_ptrs += BK
    if PDL and not EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    o = out_ptr + s.to(tl.int64) * stride_ps + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask_m)


@triton.jit(do_not_specialize=["M"])
def swap_tma(x_desc, w_desc, w_ptr, out_ptr, M, K, iters_per_split, stride_om, stride_ps,
             BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
             EARLY: tl.constexpr = False, PF: tl.constexpr = False):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    lo = s * iters_per_split
    n_it = tl.minimum(iters_per_split, tl.cdiv(K, BK) - lo)
    acc = tl.zeros((BN, BM), tl.float32)
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    if PF:
        rows = pid_n * BN + tl.arange(0, BN)
        rp = w_ptr + rows.to(tl.int64) * K + lo * BK
        nb = tl.full([BN], 0, tl.int32) + n_it * BK * 2
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;", "=r,l,r",
                                  [rp, nb], dtype=tl.int32, is_pure=False, pack=1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    k = lo * BK
    for i in range(n_it):
        w = w_desc.load([pid_n * BN, k])
        x = x_desc.load([0, k])
        acc = tl.dot(w, x.T, acc)
        k += BK
    if PDL and not EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    o = out_ptr + s.to(tl.int64) * stride_ps + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=offs_m[None, :] < M)


@triton.jit(do_not_specialize=["M"])
def noswap_ptr(x_ptr, w_ptr, out_ptr, M, K, iters_per_split, stride_xm, stride_om, stride_ps,
               BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    lo = s * iters_per_split
    n_it = tl.minimum(iters_per_split, tl.cdiv(K, BK) - lo)
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * K + (lo * BK + offs_k)[:, None]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (lo * BK + offs_k)[None, :]
    mask_m = offs_m[:, None] < M
    acc = tl.zeros((BM, BN), tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    for i in range(n_it):
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs, mask=mask_m, other=0.0)
        acc = tl.dot(x, w, acc)
        w_ptrs += BK
        x_ptrs += BK
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    o = out_ptr + s.to(tl.int64) * stride_ps + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask_m)


def launcher(kind, x, w, out, cfg):
    """A zero-arg callable running one GEMM with cfg = (bn, bk, split, stages, warps, pdl)."""
    bn, bk, split, stages, warps, pdl = cfg[:6]
    early, pf = (cfg[6], cfg[7]) if len(cfg) > 6 else (False, False)
    m, k = x.shape
    n = w.shape[0]
    bm = max(16, triton.next_power_of_2(m))
    iters = triton.cdiv(triton.cdiv(k, bk), split)
    grid = (n // bn, split)
    extra = {"launch_pdl": True} if pdl else {}
    if kind == "tma":
        xd = TensorDescriptor.from_tensor(x, [bm, bk])
        wd = TensorDescriptor.from_tensor(w, [bn, bk])
        return lambda: swap_tma[grid](xd, wd, w, out, m, k, iters, out.stride(-2), m * n, BN=bn, BM=bm, BK=bk,
                                      PDL=pdl, EARLY=early, PF=pf, num_warps=warps, num_stages=stages, **extra)
    if kind == "swap":
        return lambda: swap_ptr[grid](x, w, out, m, k, iters, x.stride(0), out.stride(-2), m * n, BN=bn, BM=bm,
                                      BK=bk, PDL=pdl, EARLY=early, PF=pf, num_warps=warps, num_stages=stages, **extra)
    return lambda: noswap_ptr[grid](x, w, out, m, k, iters, x.stride(0), out.stride(-2), m * n, BN=bn, BM=bm, BK=bk,
                                    PDL=pdl, num_warps=warps, num_stages=stages, **extra)


def graph_us(fns, rep=60):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    ms = triton.testing.do_bench(g.replay, warmup=5, rep=rep, return_mode="median")
    del g
    return ms * 1e3 / len(fns)


class Work:
    def __init__(self, name, m):
        n, k = SHAPES[name]
        self.n, self.k, self.m = n, k, m
        copies = max(8, -(-WS // (2 * n * k)))
        g = torch.Generator(device="cuda").manual_seed(0)
        self.ws = [torch.randn((n, k), generator=g, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        self.x = torch.randn((m, k), generator=g, device="cuda", dtype=torch.bfloat16)
        self.ref = (self.x.float() @ self.ws[0].float().T)

    def bytes(self):
        return 2 * (self.n * self.k + self.m * self.k + self.m * self.n)

    def run(self, kind, cfg):
        """(us per call, max abs err) of the chain; split partials in fp32 (reduce not timed here)."""
        split = cfg[2]
        outs = [torch.empty((split, self.m, self.n), device="cuda", dtype=torch.float32 if split > 1 else torch.bfloat16)
                for _ in self.ws]
        if kind == "cublas":
            outs = [torch.empty((self.m, self.n), device="cuda", dtype=torch.bfloat16) for _ in self.ws]
            fns = [(lambda w=w, o=o: torch.matmul(self.x, w.t(), out=o)) for w, o in zip(self.ws, outs)]
        else:
            fns = [launcher(kind, self.x, w, o, cfg) for w, o in zip(self.ws, outs)]
        fns[0]()
        torch.cuda.synchronize()
        got = outs[0].float().sum(0) if outs[0].dim() == 3 else outs[0].float()
        err = (got - self.ref).abs().max().item()
        return graph_us(fns), err


PF_BEST = {"qkv": ("tma", (64, 256, 1, 4, 4)), "o_proj": ("swap", (64, 128, 4, 4, 4)),
           "gate_up": ("tma", (64, 128, 1, 4, 4)), "down": ("swap", (64, 128, 4, 4, 4)),
           "lm_head": ("tma", (64, 128, 1, 4, 4))}


def pf_configs(name):
    kind, c = PF_BEST[name]
    out = [(kind, c + (True, e, p)) for e, p in ((False, False), (True, False), (True, True), (False, True))]
    alt = "swap" if kind == "tma" else "tma"
    out += [(alt, c + (True, e, p)) for e, p in ((False, False), (True, True))]
    return out


def configs(name):
    if os.environ.get("SWEEP_PF"):
        return pf_configs(name)
    splits = {"qkv": (1, 2, 4), "o_proj": (2, 4, 8), "gate_up": (1, 2, 3), "down": (2, 4, 8), "lm_head": (1,)}[name]
    tiles = [(64, 128, 4), (64, 128, 6), (64, 256, 3), (64, 256, 4), (128, 128, 4), (128, 64, 6)]
    out = []
    for kind in ("swap", "tma", "noswap"):
        for (bn, bk, st), sp in itertools.product(tiles, splits):
            if kind == "noswap" and (bn, bk, st) not in ((64, 128, 4), (64, 256, 3)):
                continue
            out.append((kind, (bn, bk, sp, st, 4, False)))
    return out


def warm(args):
    name, m, kind, cfg = args
    torch.cuda.set_device(0)
    try:
        w = Work.__new__(Work)
        n, k = SHAPES[name]
        x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
        wt = torch.randn((n, k), device="cuda", dtype=torch.bfloat16)
        o = torch.empty((cfg[2], m, n), device="cuda", dtype=torch.float32 if cfg[2] > 1 else torch.bfloat16)
        for pdl in ((None,) if len(cfg) > 6 else (False, True)):
            launcher(kind, x, wt, o, cfg if pdl is None else cfg[:5] + (pdl,))()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa
        return f"{name} {kind} {cfg}: {type(e).__name__}: {str(e)[:200]}"


def ceiling():
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", type=int, nargs="+", default=[16])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=200)
    a = ap.parse_args()
    t0 = time.time()
    jobs = [(s, m, kind, cfg) for s in a.shapes for m in a.ms for kind, cfg in configs(s)]
    import multiprocessing as mp
    with ProcessPoolExecutor(12, mp_context=mp.get_context("spawn")) as ex:
        errs = [e for e in ex.map(warm, jobs) if e]
    print(f"warm {len(jobs)} jobs in {time.time()-t0:.0f}s, {len(errs)} errors", flush=True)
    for e in errs[:10]:
        print("  ", e)
    ceil = ceiling()
    print(f"copy ceiling {ceil/1e9:.0f} GB/s", flush=True)
    rows = []
    for s in a.shapes:
        for m in a.ms:
            wk = Work(s, m)
            us, err = wk.run("cublas", (0, 0, 1, 0, 0, False))
            rows.append(dict(shape=s, m=m, kind="cublas", cfg="", us=us, pct=100 * wk.bytes() / (us * 1e-6) / ceil, err=err))
            print(f"{s:8s} M{m:<3d} cublas {'':28s} {us:7.2f} us {rows[-1]['pct']:5.1f}%", flush=True)
            best = []
            for kind, cfg in configs(s):
                if time.time() - t0 > a.budget_s:
                    break
                for pdl in ((None,) if len(cfg) > 6 else (False, True)):
                    c = cfg if pdl is None else cfg[:5] + (pdl,)
                    try:
                        us, err = wk.run(kind, c)
                    except Exception as e:  # noqa
                        print(f"{s:8s} M{m:<3d} {kind:6s} {str(c):28s} FAIL {type(e).__name__}: {str(e)[:120]}")
                        continue
                    pct = 100 * wk.bytes() / (us * 1e-6) / ceil
                    rows.append(dict(shape=s, m=m, kind=kind, cfg=str(c), us=us, pct=pct, err=err))
                    print(f"{s:8s} M{m:<3d} {kind:6s} {str(c):28s} {us:7.2f} us {pct:5.1f}% err {err:.3f}", flush=True)
            del wk
            torch.cuda.empty_cache()
    json.dump(dict(ceiling=ceil, rows=rows), open(a.out, "w"), indent=1)
    print("best per shape/M:")
    for s in a.shapes:
        for m in a.ms:
            rs = sorted((r for r in rows if r["shape"] == s and r["m"] == m), key=lambda r: r["us"])
            cb = next(r for r in rs if r["kind"] == "cublas")
            for r in rs[:3]:
                print(f"  {s:8s} M{m:<3d} {r['kind']:6s} {r['cfg']:28s} {r['us']:7.2f} us {r['pct']:5.1f}%  (cublas {cb['us']:.2f})")


if __name__ == "__main__":
    main()
