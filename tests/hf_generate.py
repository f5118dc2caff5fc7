"""Loads a `lockstep export` folder with transformers' Auto classes, as a user would (nothing
made by hand), and prints the greedy continuation of a prompt as JSON: {"text": prompt and
continuation, "tokens": new tokens, "ended": it stopped at the end-of-text token}.

    python tests/hf_generate.py FOLDER PROMPT NEW_TOKENS
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402


def main(folder, prompt, n):
    torch.set_num_threads(1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=n, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    ended = tokenizer.eos_token_id is not None and bool(new) and new[-1] == tokenizer.eos_token_id
    print(json.dumps({"text": prompt + tokenizer.decode(new), "tokens": len(new), "ended": ended}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
