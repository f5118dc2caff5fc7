"""torchtitan's trainer with lockstep's guard in its optimizer step
(python/examples/torchtitan_guard.py) against torchtitan alone, in the same run: the same
config, data, seed and initial weights, torchtitan's llama3 debug model in FSDP2 on the CPU
(tests/python/titan_cpu.py: torchtitan has no CPU mode). The runs alternate (plain, guarded on
the host, guarded through the fused AdamW, and again) so the machine's drift hits all; each
times torchtitan's train_step (forward, backward, the clip and the optimizer step, or the
guard), median over the steps after the first WARMUP. Prints the machine, the sizes and the
ratios.

    PYTHONPATH=.titan .venv/bin/torchrun --standalone --nproc-per-node 2 launch/bench_titan.py \
        [--steps 30] [--seq 256] [--batch 4] [--rounds 2] [--threads 1]
"""
import argparse
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "python", "examples"))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_guard import machine  # noqa: E402
from titan_cpu import make_assets, titan_config, titan_on_cpu  # noqa: E402

WARMUP = 3


def timed(base):
    class Timed(base):
        """Times each train_step (torchtitan's whole step)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seconds = []

        def train_step(self, data_iterator):
            start = time.perf_counter()
            super().train_step(data_iterator)
            self.seconds.append(time.perf_counter() - start)

    return Timed


def one_run(kind, a, assets, out):
    import torchtitan.trainer as titan
    from torchtitan_guard import GuardedTrainer

    config = titan_config(assets, os.path.join(out, kind), a.steps, a.seq, a.batch)
    config.metrics.log_freq = 10 ** 6  # no logging step: its reductions are not the update
    if kind == "plain":
        trainer = timed(titan.Trainer)(config)
    else:
        where = "on" if kind == "device" else "off"
        guard = {"skip": {"enabled": True, "device_decision": where}, "training": {"max_norm": 1.0}}
        trainer = timed(GuardedTrainer)(config, guard_config=guard,
                                        run_dir=os.path.join(out, kind, "lockstep"))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer.seconds[WARMUP:]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="/tmp/lockstep-bench-titan")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    titan_on_cpu()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        shutil.rmtree(a.out, ignore_errors=True)
    dist.barrier()
    assets = os.path.join(a.out, f"assets-{rank}")
    make_assets(assets)
    times = {"plain": [], "host": [], "device": []}
    for _ in range(a.rounds):
        for kind in times:
            times[kind] += one_run(kind, a, assets, a.out)
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    every = [None] * world
    dist.all_gather_object(every, ms)
    if rank == 0:
        import torchtitan

        print(f"machine: {machine()}; torch {torch.__version__}, torchtitan "
              f"{getattr(torchtitan, '__version__', '?')}, {a.threads} thread(s) a rank, "
              f"{world} ranks over Gloo, FSDP2")
        print(f"model: torchtitan llama3 debugmodel (6 layers, dim 256, vocab 2048), seq "
              f"{a.seq} x batch {a.batch} a rank; {a.rounds} rounds x {a.steps - WARMUP} timed "
              f"steps a trainer, medians")
        for r, m in enumerate(every):
            print(f"rank {r}: torchtitan alone {m['plain']:.1f} ms/step | guarded, host-decided "
                  f"{m['host']:.1f} ({m['host'] / m['plain']:.3f}x) | guarded, fused AdamW "
                  f"{m['device']:.1f} ({m['device'] / m['plain']:.3f}x)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
