"""Regenerate ``assets/tiny-qwen3-next``: a tiny Qwen3-Next hybrid (gated DeltaNet + softmax layers, MoE MLPs).

Run once: ``.venv/bin/python assets/make_tiny_qwen3_next.py``. Writes ``config.json`` (built with
transformers' ``Qwen3NextConfig``) and copies the word-level tokenizer of ``assets/tiny-llama``. There
are no weights: train it with ``train.py --model assets/tiny-qwen3-next --random-init``. Layers: GDN,
GDN, GDN, softmax (Qwen3-Next's 3:1 pattern); the GDN layers have 2 key heads and 4 value heads of 16
(grouped values), a 4-tap conv1d; the softmax layers 4 heads of 16 with 2 KV heads; 4 experts, 2 per token.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers import Qwen3NextConfig

HERE = Path(__file__).resolve().parent
OUT = HERE / "tiny-qwen3-next"


def main() -> None:
    OUT.mkdir(exist_ok=True)
    config = Qwen3NextConfig(
        vocab_size=133,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        max_position_embeddings=1048576,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    config.architectures = ["Qwen3NextForCausalLM"]
    config.save_pretrained(OUT)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(HERE / "tiny-llama" / name, OUT / name)


if __name__ == "__main__":
    main()
