"""Writes a small randomly initialised Hugging Face model folder, as save_pretrained writes
one, and what transformers computes with it: the input of `lockstep import` tests.

    python tests/hf_make.py OUT_DIR gpt2|llama|llama-sharded|llama3.2|bert

OUT_DIR/model gets config.json and model.safetensors; OUT_DIR/expected.safetensors holds
"input_ids" (2, 12) and transformers' "logits" on them (fp32, eager attention, no dropout).
"llama-sharded" saves in 200 KB shards with model.safetensors.index.json, as large models are;
"llama3.2" has Llama 3.1's rope scaling (llama3, with an original context of 32 so that its
head width of 16 has a kept, a blended and scaled frequencies) and tied embeddings; "bert" writes a model of an architecture lockstep does not train (its refusal is tested).
"""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
import transformers  # noqa: E402


def build(kind):
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=48, n_layer=2,
                                         n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config)
    if kind == "llama3.2":  # Llama 3.1/3.2's rope scaling and a tied head, as 3.2 1B ships
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 32.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=64,
                                          rms_norm_eps=1e-5, rope_parameters=rope,
                                          tie_word_embeddings=True)
        return transformers.LlamaForCausalLM(config)
    if kind.startswith("llama"):
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=64,
                                          rms_norm_eps=1e-5, rope_theta=500000.0,
                                          tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(config)
    config = transformers.BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64)
    return transformers.BertForMaskedLM(config)


def main(out, kind):
    torch.manual_seed(11)
    torch.set_num_threads(1)
    model = build(kind)
    with torch.no_grad():  # weights away from their init, so every tensor matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.config._attn_implementation = "eager"
    model.train(False)
    shard = "200KB" if kind.endswith("-sharded") else "5GB"
    model.save_pretrained(os.path.join(out, "model"), safe_serialization=True,
                          max_shard_size=shard)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    save_file({"input_ids": ids, "logits": logits.contiguous()},
              os.path.join(out, "expected.safetensors"))
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
