"""Draw the shipped document-length mixes (``benchmarks/lengths/*.json``) from published figures.

Run: ``.venv/bin/python -m benchmarks.lengths.make_mixes`` (deterministic: a fixed seed per mix).

Each mix is documents drawn from a bucketed length distribution (a bucket by its published share of
documents, then a length log-uniform inside it), packed in draw order into rows of ``seq_len`` tokens:

* ``longtail_128k`` (long-tail fine-tuning mix, rows of 128K): short documents follow the DCLM-Baseline
  bucket table of Dataset Decomposition (arXiv 2405.13226, the counts per 256..8K bucket in the README of
  apple/ml-dataset-decomposition, as shares of sequences: 36.8 / 31.0 / 19.2 / 8.2 / 3.3 / 1.5 %); the
  long tail is set so that documents shorter than 64K hold ~75 % of the tokens, the share WLB-LLM
  (arXiv 2503.17924, section 2.2) reports for a 128K-context job. Packed SFT-style: a document that does
  not fit closes the row, whose rest is padding.
* ``cpt_1m`` (continued pretraining, rows of 1M): ByteScale's Byted dataset (arXiv 2502.21231, section
  3.1): ~80 % of documents <= 4K, ~19 % in 4K-128K, ~1 % >= 128K (holding ~44 % of the tokens there,
  with documents up to 2M; capped at 1M here they hold ~36 %). Packed concat-and-chunk: the document
  that overflows a row continues in the next one.
* ``uniform_32k`` (control, rows of 128K): lengths uniform in [1, 32768]; SFT-style packing.

Files hold ``{"name", "source", "drawn", "seq_len", "rows": [[lengths of row 0], ...]}``; a row's
lengths sum to at most ``seq_len`` (the rest is padding).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

HERE = Path(__file__).parent
ROWS = 32  # rows per mix

# (low, high, share of documents): lengths log-uniform in [low, high)
DCLM_SHORT = [(128, 256, 0.368), (256, 512, 0.310), (512, 1024, 0.192), (1024, 2048, 0.082),
              (2048, 4096, 0.033), (4096, 8192, 0.015)]  # fmt: skip
LONGTAIL_TAIL = [(8192, 65536, 0.020), (65536, 131072, 0.0043)]  # ~25 % of the tokens in >= 64K
BYTED = [(64, 4096, 0.80), (4096, 131072, 0.19), (131072, 1048577, 0.01)]

MIXES = {
    "longtail_128k": dict(
        buckets=DCLM_SHORT + LONGTAIL_TAIL,
        seq_len=131072,
        packing="sft",
        source="Dataset Decomposition (arXiv 2405.13226) DCLM-Baseline buckets for <= 8K; the tail set so "
        "documents < 64K hold ~75 % of the tokens (WLB-LLM, arXiv 2503.17924, section 2.2)",
    ),
    "cpt_1m": dict(
        buckets=BYTED,
        seq_len=1048576,
        packing="chunk",
        source="ByteScale (arXiv 2502.21231) section 3.1, Byted dataset: ~80 % of documents <= 4K, "
        "~1 % >= 128K holding ~44 % of the tokens; tail capped at 1M",
    ),
    "uniform_32k": dict(
        buckets=[(1, 32769, 1.0)],
        seq_len=131072,
        packing="sft",
        source="control: lengths uniform in [1, 32768]",
        uniform=True,
    ),
}


def draw_length(rng: random.Random, buckets: list[tuple[int, int, float]], uniform: bool) -> int:
    """One document length: a bucket by its share, then log-uniform (uniform for the control) inside."""
    low, high, _ = rng.choices(buckets, weights=[b[2] for b in buckets])[0]
    if uniform:
        return rng.randrange(low, high)
    return min(high - 1, int(math.exp(rng.uniform(math.log(low), math.log(high)))))


def pack(rng: random.Random, spec: dict, rows: int) -> list[list[int]]:
    """Rows of document lengths (module doc: SFT-style or concat-and-chunk)."""
    seq_len, out, row, carry = spec["seq_len"], [], [], 0
    while len(out) < rows:
        length = carry or draw_length(rng, spec["buckets"], spec.get("uniform", False))
        carry = 0
        room = seq_len - sum(row)
        if length <= room:
            row.append(length)
            continue
        if spec["packing"] == "chunk":
            row.append(room)
            carry = length - room
        out.append(row)
        row = [] if spec["packing"] == "chunk" else [length]
    return out


def main() -> None:
    for seed, (name, spec) in enumerate(MIXES.items()):
        rows = pack(random.Random(seed), spec, ROWS)
        flat = [x for row in rows for x in row]
        payload = {
            "name": name,
            "source": spec["source"],
            "drawn": f"random.Random({seed}); {ROWS} rows; buckets {spec['buckets']}; packing {spec['packing']}",
            "seq_len": spec["seq_len"],
            "rows": rows,
        }
        (HERE / f"{name}.json").write_text(json.dumps(payload, separators=(",", ":")) + "\n")
        long = sum(x for x in flat if x >= 65536) / sum(flat)
        print(
            f"{name}: {len(rows)} rows, {len(flat)} documents, max {max(flat)}, tokens in >= 64K: {long:.1%}"
        )


if __name__ == "__main__":
    main()
