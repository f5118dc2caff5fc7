"""A plain PyTorch DDP loop with lockstep's guard: a small causal transformer on random tokens,
one NaN loss injected on rank 1 at step 30 to show a skip. Run (the README's example):

    .venv/bin/pip install --no-build-isolation .      # once, in the repository root
    .venv/bin/torchrun --standalone --nproc-per-node 2 python/examples/ddp_guard.py
Then `build/bin/lockstep diag runs/ddp_guard` names the culprit rank and the poisoned sample.
"""
import gc
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import lockstep.torch

VOCAB, SEQ, BATCH, STEPS = 128, 32, 8, 50


class TinyLM(nn.Module):
    def __init__(self, dim=64, layers=2, heads=4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(block, layers)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.blocks(self.embed(x), mask=mask, is_causal=True))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logging.basicConfig(format=f"[rank {rank}] %(message)s", level=logging.INFO)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyLM()
    ddp_model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = lockstep.torch.SkipGuard(optimizer, {"skip": {"enabled": True}}, run_dir="runs/ddp_guard",
                                     model=model, ddp=ddp_model)
    data = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=data)
        ids = [step * 100 + rank * BATCH + i for i in range(BATCH)]
        logits = ddp_model(tokens[:, :-1])
        losses = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)
        if rank == 1 and step == 30:
            losses = losses * torch.tensor([1.0] * (BATCH - 1) + [float("nan")])  # a bad sample
        loss = losses.mean()
        optimizer.zero_grad()
        loss.backward()
        verdict = guard.step(loss, sample_ids=ids, sample_losses=losses.tolist())
        if rank == 0 and step % 10 == 0:
            logging.info(f"step {verdict.step} | loss {verdict.loss:.4f} | grad_norm {verdict.grad_norm:.4f} "
                         f"| {verdict.decision} | skipped {guard.skipped_steps}")
    del ddp_model  # DDP must not outlive its process group: Gloo may abort the exit otherwise
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
