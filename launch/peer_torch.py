"""The PyTorch peer of a lockstep GPU run: the same GPT or Llama shape trained in plain PyTorch,
eager or under torch.compile, so a lockstep tokens/s figure is a ratio measured in the same lease.

GPT is launch/reference_gpt.py's model (lockstep's architecture). Llama is written here in plain
PyTorch with lockstep's (and torchtitan's) shapes: RMSNorm, rotary embeddings (theta), grouped-
query attention through scaled_dot_product_attention, SwiGLU with the hidden width rounded up to
multiple_of, an untied output layer. Both train with fused AdamW (lockstep's hyperparameters) and
clip_grad_norm_(1.0), bf16 under torch.autocast; random tokens (speed does not depend on them).
Needs only torch (the GPU machine has no transformers).

    python3 launch/peer_torch.py --model llama --dim 2048 --layers 16 --heads 16 --kv-heads 8 \\
        --seq 2048 --batch 4 --steps 20 --precision bfloat16 --device cuda --compile
Prints one JSON line: tokens/s over the timed steps, the final loss, the peak GPU memory.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_gpt import Gpt  # noqa: E402


class LlamaBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden, eps):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attention_norm = nn.RMSNorm(dim, eps=eps)
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim, eps=eps)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    @staticmethod
    def rope(x, cos, sin):  # x: (B, H, T, D), pairs (2i, 2i + 1) rotated as complex numbers
        x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2).type_as(x)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, vocab, dim, layers, heads, kv_heads, seq, theta, multiple_of, eps=1e-5):
        super().__init__()
        hidden = 2 * (4 * dim) // 3
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, heads, kv_heads, hidden, eps)
                                    for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.output = nn.Linear(dim, vocab, bias=False)
        head_dim = dim // heads
        freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(seq).float(), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for name, p in self.named_parameters():  # torchtitan's init (depth scaling left out)
            if p.dim() == 2:
                nn.init.trunc_normal_(p, std=1.0 if "tok_embeddings" in name else 0.02)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, self.cos[:T], self.sin[:T])
        return self.output(self.norm(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    for name, default in (("vocab", 256), ("dim", 128), ("layers", 2), ("heads", 4),
                          ("kv-heads", 0), ("mlp-ratio", 4), ("multiple-of", 256), ("seq", 64),
                          ("batch", 16), ("steps", 20), ("warmup", 5), ("threads", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--precision", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    a = p.parse_args()
    torch.manual_seed(42)
    torch.set_num_threads(a.threads)
    torch.backends.cuda.matmul.allow_tf32 = True  # lockstep's training.allow_tf32 default
    torch.backends.cudnn.allow_tf32 = True
    dev = torch.device(a.device)
    if a.model == "gpt":
        model = Gpt(a.vocab, a.dim, a.layers, a.heads, a.mlp_ratio, a.seq)
    else:
        model = Llama(a.vocab, a.dim, a.layers, a.heads, a.kv_heads or a.heads, a.seq,
                      a.rope_theta, a.multiple_of)
    model = model.to(dev)
    params = sum(q.numel() for q in model.parameters())
    decay = [q for q in model.parameters() if q.dim() >= 2]
    other = [q for q in model.parameters() if q.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    forward = torch.compile(model) if a.compile else model
    dtype = torch.bfloat16 if a.precision == "bfloat16" else None
    data = torch.randint(0, a.vocab, (a.warmup + a.steps, a.batch, a.seq + 1), device=dev)
    start, compile_s, t0 = 0.0, 0.0, time.perf_counter()
    loss = torch.zeros(())
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            compile_s = start - t0  # warm-up steps, compilation included
        x, y = data[step, :, :-1], data[step, :, 1:]
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            logits = forward(x)
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
    loss_value = loss.item()
    secs = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else math.nan
    print(json.dumps({"trainer": "pytorch-" + ("compile" if a.compile else "eager"),
                      "model": a.model, "parameters": params, "precision": a.precision,
                      "torch": torch.__version__, "seq": a.seq, "batch": a.batch,
                      "tokens_per_s": a.steps * a.batch * a.seq / secs,
                      "warmup_s": round(compile_s, 1), "final_loss": loss_value,
                      "peak_gpu_gib": round(peak, 2)}))


if __name__ == "__main__":
    main()
