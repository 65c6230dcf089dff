"""Regenerate ``assets/tiny-modernbert`` (config + word-level tokenizer) used by ``train.py --objective mlm``.

Run once: ``.venv/bin/python assets/make_tiny_modernbert.py``. The files it writes are committed; nothing
is downloaded. Vocabulary: the tiny Llama's (``assets/make_tiny_llama.py``) plus ``<mask>``. The model is a
2-layer ModernBERT: layer 0 global attention, layer 1 a local window of 128 tokens (64 on each side).
"""

from __future__ import annotations

import json
from pathlib import Path

from make_tiny_llama import SPECIAL, VOCAB
from tokenizers import Tokenizer, models, pre_tokenizers

OUT = Path(__file__).resolve().parent / "tiny-modernbert"
WORDS = [*VOCAB, "<mask>"]


def main() -> None:
    OUT.mkdir(exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(OUT / "tokenizer.json"))
    (OUT / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "pad_token": SPECIAL[0],
                "unk_token": SPECIAL[1],
                "bos_token": SPECIAL[2],
                "eos_token": SPECIAL[3],
                "mask_token": "<mask>",
                "model_max_length": 1048576,
            },
            indent=2,
        )
        + "\n"
    )
    config = {
        "architectures": ["ModernBertForMaskedLM"],
        "model_type": "modernbert",
        "vocab_size": len(WORDS),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 1048576,
        "global_attn_every_n_layers": 2,
        "local_attention": 128,
        "attention_dropout": 0.0,
        "mlp_dropout": 0.0,
        "embedding_dropout": 0.0,
        "classifier_dropout": 0.0,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 3,
        "cls_token_id": 2,
        "sep_token_id": 3,
        "mask_token_id": len(WORDS) - 1,
    }
    (OUT / "config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
