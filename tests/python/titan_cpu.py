"""torchtitan on the CPU, for tests/python/titan_guard.py and launch/bench_titan.py: torchtitan
has no CPU mode, so titan_on_cpu() gives it one and says where (its device module answers from
the CPU; FlexAttention's compiled kernel, which has no CPU backward, becomes PyTorch's
scaled_dot_product_attention over the same block mask; FSDP2's reduce-scatter sums, as Gloo has
no PREMUL_SUM; a no-op for the dist.set_timeout torch 2.13 lacks, which only shortens a
timeout), make_assets() writes a tokenizer and a local dataset (no network), and titan_config()
is torchtitan's llama3 debug model over them, on its "partial_dtensor" SPMD backend (its default,
"spmd_types", needs a newer FSDP2 than torch 2.13's).
"""
import importlib
import importlib.util
import json
import os
import random
import sys
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _kernels_standin(module_name):
    """A module whose every name is a kernel that raises when launched (see below)."""
    module = types.ModuleType(module_name)

    def missing(name):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args, **kwargs):
            raise RuntimeError(f"{module_name}.{name} needs triton (pip install triton)")
        return kernel

    module.__getattr__ = missing
    return module


# torchtitan 0.3.0 imports its expert-parallel Triton kernels at import time, even in runs that
# use no expert parallelism; the CPU torch wheel has no triton (0.9 GB). Without it, that one
# module is a stand-in (torch itself still sees no triton); torchtitan-requirements.txt says so.
TITAN_TRITON_MODULE = "torchtitan.distributed.minimal_async_ep.kernels"
if importlib.util.find_spec("triton") is None:
    sys.modules.setdefault(TITAN_TRITON_MODULE, _kernels_standin(TITAN_TRITON_MODULE))


def titan_on_cpu():
    """torchtitan's device calls answered by the CPU (see the module's docstring)."""
    props = types.SimpleNamespace(name="cpu", total_memory=1 << 34)
    cpu = types.SimpleNamespace(
        set_device=lambda d: None, current_device=lambda: 0, device_count=lambda: 1,
        get_device_name=lambda d=None: "cpu", get_device_properties=lambda d=None: props,
        reset_peak_memory_stats=lambda d=None: None, empty_cache=lambda: None,
        memory_stats=lambda d=None: {"active_bytes.all.peak": 0, "active_bytes.all.current": 0,
                                     "reserved_bytes.all.peak": 0, "num_alloc_retries": 0,
                                     "num_ooms": 0},
        synchronize=lambda d=None: None, is_available=lambda: True)
    for name in ("torchtitan.tools.utils", "torchtitan.components.metrics",
                 "torchtitan.distributed.utils", "torchtitan.distributed.parallel_dims",
                 "torchtitan.trainer"):
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = cpu
    local = lambda: torch.device("cpu")  # noqa: E731
    importlib.import_module("torchtitan.tools.utils").get_local_device = local
    importlib.import_module("torchtitan.distributed.utils").get_local_device = local

    from torch.nn.attention.flex_attention import create_mask
    from torchtitan.models.common.attention import FlexAttention

    def attention(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                  return_aux=None, kernel_options=None):
        assert score_mod is None, "the stand-in has no score_mod"
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], q.device)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), None

    FlexAttention.compiled_flex_attn = staticmethod(attention)

    # torchtitan sets FSDP2's gradient divide factor to 1 (it divides by the global token count
    # itself), which FSDP2 sends as PREMUL_SUM(1): Gloo has no PREMUL_SUM, so its SUM is forced.
    fsdp = importlib.import_module("torchtitan.distributed.fsdp")
    divide = fsdp.disable_fsdp_gradient_division

    def sum_on_gloo(model):
        divide(model)
        for m in model.modules():
            if isinstance(m, fsdp.FSDPModule):
                m.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = sum_on_gloo
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: None


def make_assets(folder):
    """A byte-level BPE tokenizer (tests/tok_train.py) and a local JSON dataset of text."""
    from tok_train import main as train_tokenizer

    rng = random.Random(0)
    words = ("the of and to in a is that for it as was with be by on not he this are or his "
             "from at which but have an they you were her she there had been one all we their "
             "what so up out if about who them would my when more no").split()
    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    os.makedirs(os.path.join(folder, "tokenizer"), exist_ok=True)
    with open(os.path.join(folder, "data", "train.json"), "w") as f:
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(300))}) + "\n")
    corpus = os.path.join(folder, "corpus.txt")
    with open(corpus, "w") as f:
        f.write(" ".join(words * 20))
    train_tokenizer(os.path.join(folder, "tokenizer", "tokenizer.json"), 400, [corpus])
    with open(os.path.join(folder, "tokenizer", "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}, f)


def titan_config(folder, run_dir, steps, seq_len=64, batch=2):
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    c = llama3_debugmodel()
    c.hf_assets_path = os.path.join(folder, "tokenizer")
    c.dataloader.dataset_path = os.path.join(folder, "data")
    c.training.seq_len, c.training.local_batch_size, c.training.steps = seq_len, batch, steps
    c.checkpoint.enable = False
    c.validator.enable = False
    c.activation_checkpoint = None
    c.debug.seed = 0
    c.parallelism.spmd_backend = "partial_dtensor"  # spmd_types needs a newer torch
    c.dump_folder = run_dir
    return c
