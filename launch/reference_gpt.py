"""A plain PyTorch eager trainer of lockstep's GPT, the baseline of launch/bench_precision.sh.

The same architecture as src/model/gpt.cpp (token + position embeddings, pre-LayerNorm blocks
with fused qkv, causal scaled_dot_product_attention, tanh-GELU MLP, final LayerNorm, output head
tied to the token embedding), the same init, fused AdamW with the same hyperparameters and
weight-decay groups, gradient clipping. bf16 and fp16 run under torch.autocast, as PyTorch
users train in mixed precision; fp16 adds torch.amp.GradScaler.

    python launch/reference_gpt.py --dim 512 --layers 4 --heads 8 --seq 128 --batch 8 \\
        --steps 30 --precision bfloat16 --threads 2
Prints one JSON line: tokens/s over the timed steps, the final loss, peak resident memory.
"""
import argparse
import json
import math
import resource
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio, std, std_res):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)
        for lin, s in ((self.qkv, std), (self.proj, std_res), (self.fc, std), (self.fc2, std_res)):
            nn.init.normal_(lin.weight, 0.0, s)
            nn.init.zeros_(lin.bias)

    def forward(self, x):  # (B, T, C)
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        heads = lambda t: t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, vocab, dim, layers, heads, mlp_ratio, max_seq, std=0.02):
        super().__init__()
        self.wte = nn.Parameter(torch.empty(vocab, dim).normal_(0.0, std))
        self.wpe = nn.Parameter(torch.empty(max_seq, dim).normal_(0.0, std))
        std_res = std / math.sqrt(2 * layers)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio, std, std_res) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, idx):  # (B, T) -> logits (B, T, V)
        x = F.embedding(idx, self.wte) + self.wpe[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return F.linear(self.ln_f(x), self.wte)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mlp-ratio", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first")
    p.add_argument("--precision", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    torch.manual_seed(42)
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    model = Gpt(a.vocab, a.dim, a.layers, a.heads, a.mlp_ratio, a.seq).to(dev)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    other = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    dtype = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[a.precision]
    scaler = torch.amp.GradScaler(dev.type, enabled=a.precision == "float16")
    data = torch.randint(0, a.vocab, (a.warmup_steps + a.steps, a.batch, a.seq + 1), device=dev)
    loss = torch.tensor(0.0)
    for step in range(a.warmup_steps + a.steps):
        if step == a.warmup_steps:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        x, y = data[step, :, :-1], data[step, :, 1:]
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), y.reshape(-1))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)
    loss_value = loss.item()
    secs = time.perf_counter() - start
    print(json.dumps({"trainer": "pytorch-eager", "precision": a.precision, "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "tokens_per_s": a.steps * a.batch * a.seq / secs,
                      "final_loss": loss_value,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
