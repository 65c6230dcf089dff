"""Regenerate ``assets/tiny-minimax``: a tiny MiniMax hybrid (Lightning linear attention + softmax layers).

Run once: ``.venv/bin/python assets/make_tiny_minimax.py``. Writes ``config.json`` (built with
transformers' ``MiniMaxConfig``) and copies the word-level tokenizer of ``assets/tiny-llama``. There are
no weights: train it with ``train.py --model assets/tiny-minimax --random-init``. Layers alternate
linear, softmax, linear, softmax; 4 heads of 16 (2 KV heads in the softmax layers), 2 experts.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers import MiniMaxConfig

HERE = Path(__file__).resolve().parent
OUT = HERE / "tiny-minimax"


def main() -> None:
    OUT.mkdir(exist_ok=True)
    config = MiniMaxConfig(
        vocab_size=133,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        max_position_embeddings=1048576,
        block_size=64,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    config.architectures = ["MiniMaxForCausalLM"]
    config.save_pretrained(OUT)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(HERE / "tiny-llama" / name, OUT / name)


if __name__ == "__main__":
    main()
