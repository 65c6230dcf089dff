"""Regenerate ``assets/tiny-llama`` (config + word-level tokenizer) used by ``train.py``'s default job.

Run once: ``.venv/bin/python assets/make_tiny_llama.py``. The files it writes are committed; nothing
is downloaded. Vocabulary: 5 special/marker tokens, 64 filler words ``f0..f63`` and 64 passkey
words ``k0..k63``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

OUT = Path(__file__).resolve().parent / "tiny-llama"
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "?"]
VOCAB = SPECIAL + [f"f{i}" for i in range(64)] + [f"k{i}" for i in range(64)]


def main() -> None:
    OUT.mkdir(exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(OUT / "tokenizer.json"))
    (OUT / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": 1048576,
            },
            indent=2,
        )
        + "\n"
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(VOCAB),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-6,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 3,
    }
    (OUT / "config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
