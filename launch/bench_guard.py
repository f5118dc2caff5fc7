"""The guarded step against PyTorch's own, in the same run: lockstep.torch.SkipGuard.step(loss)
vs clip_grad_norm_(max_norm) + optimizer.step(), on the same Llama (launch/peer_torch.py's),
the same batches and the same initial weights, the two interleaved step by step (the order
alternating) so the machine's drift hits both. Times the whole step (forward, backward, update)
and the update alone (after backward: the clip and the optimizer, or the guard), median over the
timed steps, for AdamW's default (foreach: the guard decides on the host) and fused AdamW (the
guard decides on the device: found_inf, grad_scale).

    .venv/bin/python launch/bench_guard.py [--dim 512 --layers 4 ...]
    torchrun --nproc-per-node 2 launch/bench_guard.py ...     (DDP over Gloo, each rank a line)
On a GPU (--device cuda) it also counts host syncs of the guarded step (CUDA's sync debug mode).
"""
import argparse
import gc
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_torch import Llama  # noqa: E402

import lockstep.torch as lt  # noqa: E402


def machine():
    model, flags = platform.processor() or "?", []
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and model in ("?", ""):
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    flags = [x for x in ("avx2", "avx512f", "avx512_bf16") if x in have]
                    break
    except OSError:
        pass
    return f"{model} ({', '.join(flags) or 'no avx2'}), {os.cpu_count()} cores"


class Run:
    """One trainer: its model (wrapped in DDP on several ranks), optimizer, and the update."""

    def __init__(self, a, fused, guarded, dev):
        torch.manual_seed(0)
        self.model = Llama(a.vocab, a.dim, a.layers, a.heads, a.kv_heads, a.seq, 10000.0,
                           a.multiple_of).to(dev)
        self.forward = self.model
        ddp = None
        if dist.is_initialized():
            ddp = self.forward = torch.nn.parallel.DistributedDataParallel(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                                     weight_decay=0.1, fused=fused, foreach=None if fused else True)
        # a fused AdamW: the device-decided path, on a CPU too (there "auto" decides on the host)
        skip = {"enabled": True, "device_decision": "on" if fused else "off"}
        self.guard = lt.SkipGuard(self.opt, {"skip": skip}, model=self.model,
                                  ddp=ddp, training_max_norm=a.max_norm) if guarded else None
        self.max_norm = a.max_norm
        self.total, self.update = [], []

    def step(self, x, y, dev):
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        logits = self.forward(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        sync()
        t1 = time.perf_counter()
        if self.guard is not None:
            self.guard.step(loss)
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm, foreach=True)
            self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        sync()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1


def syncs_per_clean_step(run, x, y, dev):
    """Host syncs inside guard.step on a clean step, counted by CUDA's sync debug mode."""
    import warnings
    logits = run.forward(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        run.guard.step(loss)
        torch.cuda.set_sync_debug_mode("default")
    run.opt.zero_grad(set_to_none=False)
    return sum("synchroniz" in str(w.message) for w in caught)


def main():
    p = argparse.ArgumentParser()
    for name, default in (("vocab", 8192), ("dim", 512), ("layers", 4), ("heads", 8),
                          ("kv-heads", 4), ("multiple-of", 256), ("seq", 256), ("batch", 8),
                          ("steps", 20), ("warmup", 3), ("threads", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device, rank) if a.device == "cuda" else torch.device(a.device)
    g = torch.Generator().manual_seed(1 + rank)
    data = torch.randint(0, a.vocab, (a.warmup + a.steps, a.batch, a.seq + 1), generator=g).to(dev)
    out = []
    for fused in (False, True):
        runs = [Run(a, fused, False, dev), Run(a, fused, True, dev)]
        params = sum(q.numel() for q in runs[0].model.parameters())
        for i in range(a.warmup + a.steps):
            x, y = data[i, :, :-1], data[i, :, 1:]
            for r in (runs if i % 2 == 0 else runs[::-1]):
                total, update = r.step(x, y, dev)
                if i >= a.warmup:
                    r.total.append(total)
                    r.update.append(update)
        plain, guarded = runs
        med = statistics.median
        line = (f"{'fused' if fused else 'foreach'} AdamW ({'device' if guarded.guard.on_device else 'host'}"
                f" decision): step {med(plain.total) * 1e3:.1f} -> {med(guarded.total) * 1e3:.1f} ms "
                f"({med(guarded.total) / med(plain.total):.3f}x); update {med(plain.update) * 1e3:.2f} -> "
                f"{med(guarded.update) * 1e3:.2f} ms ({med(guarded.update) / med(plain.update):.2f}x)")
        if dev.type == "cuda":
            line += f"; host syncs in a clean guarded step: {syncs_per_clean_step(guarded, x, y, dev)}"
        out.append(line)
    if rank == 0:
        print(f"machine: {machine()}; torch {torch.__version__}, {a.threads} threads, {world} rank(s), {dev}")
        print(f"model: Llama dim {a.dim}, {a.layers} layers, vocab {a.vocab}, {params / 1e6:.1f} M "
              f"parameters; batch {a.batch} x seq {a.seq}; {a.steps} timed steps after {a.warmup}; "
              f"baseline clip_grad_norm_({a.max_norm}, foreach) + optimizer.step()")
        for line in out:
            print(line)
    if dist.is_initialized():
        del runs, plain, guarded
        gc.collect()  # DDP modules go before the process group (Gloo may abort the exit)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
