"""Checks a `lockstep export` folder against Hugging Face transformers, an independent
implementation of the same models (GPT2LMHeadModel, LlamaForCausalLM).

    python tests/hf_reference.py EXPORT_DIR EXPECTED.safetensors

EXPECTED holds what lockstep computed on the same weights: "input_ids" (B, T), "logits"
(B, T, V), "loss" (the mean token cross-entropy against "targets"), and "grad.<name>" for every
parameter, in transformers' names and layouts. transformers loads the folder offline, computes
the same loss, back-propagates, and every number must agree within the stated tolerances (fp32
on the CPU; the two differ only in the order of floating-point operations). Exit 0 when they
do, 1 with the worst differences when they do not.
"""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

LOGITS_ATOL = 1e-5   # absolute, on logits of magnitude ~1-10
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4     # ||ours - theirs|| / ||theirs|| per tensor


def main(export_dir, expected_file):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    want = load_file(expected_file)
    model = AutoModelForCausalLM.from_pretrained(
        export_dir, local_files_only=True, dtype=torch.float32, attn_implementation="eager")
    model.train(False)  # no dropout (the export's are 0 anyway)
    out = model(input_ids=want["input_ids"])
    logits = out.logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), want["targets"].reshape(-1))
    loss.backward()

    failures = []
    d_logits = (logits.detach() - want["logits"]).abs().max().item()
    print(f"{model.config.architectures[0]}: logits {tuple(logits.shape)}, "
          f"max |lockstep - transformers| = {d_logits:.3g} (tolerance {LOGITS_ATOL:g})")
    if not d_logits <= LOGITS_ATOL:
        failures.append(f"logits differ by {d_logits:.3g}")
    d_loss = abs(loss.item() - want["loss"].item()) / abs(loss.item())
    print(f"loss {loss.item():.6f} (lockstep {want['loss'].item():.6f}), relative difference "
          f"{d_loss:.3g} (tolerance {LOSS_RTOL:g})")
    if not d_loss <= LOSS_RTOL:
        failures.append(f"loss differs by {d_loss:.3g}")

    params = dict(model.named_parameters())
    grads = {k[len("grad."):]: v for k, v in want.items() if k.startswith("grad.")}
    missing = sorted(set(params) - set(grads))
    if missing:
        failures.append(f"no lockstep gradient for {missing}")
    worst = (0.0, "")
    for name, g in grads.items():
        if name not in params:
            failures.append(f"lockstep has gradient '{name}' transformers' model lacks")
            continue
        theirs = params[name].grad
        rel = ((g - theirs).norm() / theirs.norm().clamp_min(1e-30)).item()
        worst = max(worst, (rel, name))
        if not rel <= GRAD_RTOL:
            failures.append(f"gradient of {name} differs by {rel:.3g} (relative)")
    print(f"gradients of {len(grads)} parameters: worst relative difference {worst[0]:.3g} "
          f"({worst[1]}; tolerance {GRAD_RTOL:g})")
    for f in failures:
        print("MISMATCH:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
