"""A tiny randomly initialised Qwen3.5-architecture model for the transformers engine's tests.

Text-only ``Qwen3_5ForCausalLM`` with the shipped stack's layer pattern (two groups of three
gated-DeltaNet layers and one full-attention layer), attention head dim 256 with GQA, and MLP
sizes that meet the QPN contract (K % 64 == 0, N % 32 == 0). Its tokenizer is the Llama
fixture's (``dflash_fixtures/hf_model``). Saved with ``save_pretrained``, so the engine loads it
exactly as it loads any local model directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

GROUP = ["linear_attention"] * 3 + ["full_attention"]


def make_qwen35(path: Path, seed: int = 0, groups: int = 2) -> Path:
    """Write the model and its tokenizer to ``path``; returns ``path``."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from pytest_dflash.engines.transformers import llama_model_dir

    llama = llama_model_dir()
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=2048, hidden_size=128, intermediate_size=256, layer_types=GROUP * groups,
        num_hidden_layers=4 * groups, num_attention_heads=2, num_key_value_heads=1,
        head_dim=256, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        tie_word_embeddings=True)
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():  # random init leaves the norms at zero (weight + 1); vary them a bit
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.1)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama / name, path / name)
    return path
