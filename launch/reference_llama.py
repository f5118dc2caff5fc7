"""Hugging Face transformers' LlamaForCausalLM trained in plain PyTorch eager: the baseline of
launch/bench_llama.sh. The same shape as lockstep's llama model (the config below mirrors
lockstep's keys), fused AdamW with lockstep's hyperparameters, gradient clipping, random tokens
(speed does not depend on the text). bf16 runs under torch.autocast, as PyTorch users train.

    python launch/reference_llama.py --dim 256 --layers 6 --heads 16 --seq 128 --batch 8 \\
        --steps 25 --warmup 5 --precision bfloat16 --threads 2
Prints one JSON line: tokens/s over the timed steps, the final loss.
"""
import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    for name, default in (("dim", 256), ("layers", 6), ("heads", 16), ("kv_heads", 0),
                          ("ffn", 768), ("vocab", 256), ("seq", 128), ("batch", 8),
                          ("steps", 25), ("warmup", 5), ("threads", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--precision", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.dim, intermediate_size=a.ffn,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads,
                         num_key_value_heads=a.kv_heads or a.heads, max_position_embeddings=a.seq,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=True)
    tokens = torch.randint(0, a.vocab, (a.steps, a.batch, a.seq + 1))
    start = None
    for step in range(a.steps):
        if step == a.warmup:
            start = time.perf_counter()
        x, y = tokens[step, :, :-1], tokens[step, :, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bfloat16"):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    seconds = time.perf_counter() - start
    print(json.dumps({"trainer": "transformers", "precision": a.precision,
                      "tokens_per_s": (a.steps - a.warmup) * a.batch * a.seq / seconds,
                      "loss": loss.item()}))


if __name__ == "__main__":
    main()
