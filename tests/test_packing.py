"""Length-aware packing (``tasks/packing.py``) and ``train.py --packing balanced``: whole documents, rows
of one degree, and training under ``dynamic_degree`` equal to one process."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from ds_seqpar.cli import DEFAULT_CONFIG
from ds_seqpar.data import doc_ids_from_positions
from ds_seqpar.errors import SeqParConfigError
from ds_seqpar.layout import document_lengths, dynamic_placement
from ds_seqpar.tasks.packing import degree_of, pack_by_degree
from tests.helpers.cli_runs import run_cli


def _row_lengths(row: dict) -> list[int]:
    docs = doc_ids_from_positions(row["position_ids"][None]).masked_fill(row["attention_mask"][None] == 0, -1)
    return document_lengths(docs)


def test_every_document_is_in_one_row_whole():
    rng = random.Random(0)
    docs = [torch.arange(1000 * i, 1000 * i + rng.randint(1, 300)) for i in range(80)]
    rows = pack_by_degree(docs, 256, 4, eos_id=7)
    seen = []
    for row in rows:
        assert all(row[k].shape == (256,) for k in ("input_ids", "labels", "position_ids", "attention_mask"))
        real = row["attention_mask"].bool()
        assert not real[real.long().argmin() :].any() or real.all()  # padding only at the end
        assert (row["labels"][~real] == -100).all()
        starts = [*torch.nonzero(row["position_ids"][real] == 0).flatten().tolist(), int(real.sum())]
        for a, b in itertools.pairwise(starts):
            seen.append(row["input_ids"][a:b].tolist())
            starts_document = seen[-1][0] % 1000 == 0  # a document's first token (not a cut-off rest of one)
            assert (row["labels"][a] == -100) == starts_document
            assert row["labels"][a + 1 : b].tolist() == seen[-1][1:]
    expected = sorted(([*d.tolist(), 7])[:256] for d in docs)  # documents of 256 tokens or more: cut
    expected += sorted(([*d.tolist(), 7])[256:] for d in docs if len(d) + 1 > 256)
    assert sorted(seen) == sorted(expected)


def test_rows_run_at_the_degree_their_documents_need():
    rng = random.Random(1)
    docs = [
        torch.ones(rng.choice([rng.randint(4, 60), rng.randint(70, 120)]), dtype=torch.long)
        for _ in range(300)
    ]
    rows = pack_by_degree(docs, 512, 4, eos_id=2)
    degrees = []
    for row in rows:
        lengths = _row_lengths(row)
        plan = dynamic_placement(lengths, 512, 4)
        degrees.append(plan.degree if plan is not None else 4)
        assert degrees[-1] >= max(degree_of(x, 512, 4) for x in lengths)
    filled = sum(int(r["attention_mask"].sum()) for r in rows) / (512 * len(rows))
    assert filled > 0.9 and degrees.count(1) >= len(rows) // 2, (filled, degrees)


def test_bad_lengths_are_refused_by_name():
    with pytest.raises(SeqParConfigError, match="S=250, P=4; fix: a --seq-len that is a multiple of 4"):
        pack_by_degree([[1, 2]], 250, 4, eos_id=None)


def _config(tmp_path, size: int, dynamic: bool) -> str:
    config = json.loads(DEFAULT_CONFIG.read_text())
    section = config["sequence_parallel"]
    section.update(size=size, ulysses_degree=1, ring={"layout": "documents"}, dynamic_degree=dynamic)
    path = tmp_path / f"sp{size}_{dynamic}.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_balanced_packing_trains_like_one_process(dist_pool, tmp_path):
    """--packing balanced on documents of 3-150 tokens in rows of 256: 4 steps on 4 ranks with a dynamic
    degree (rows at p = 1, 2 and 4) give the losses of one process."""
    rng = random.Random(3)
    docs = [" ".join(f"f{(i * 7 + j) % 64}" for j in range(rng.choice([3, 20, 70, 150]))) for i in range(40)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    losses = {}
    for size, dynamic in ((4, True), (1, False)):
        argv = ["--ds_config", _config(tmp_path, size, dynamic), "--data", str(data), "--packing", "balanced"]
        argv += ["--seq-len", "256", "--max-steps", "4", "--eval-every", "0", "--no-progress", "--no-export"]
        argv += ["--lr", "1e-3", "--output-dir", str(tmp_path / f"run{size}")]
        rows = dist_pool(size).run(run_cli, argv)[0]
        losses[size] = [r["loss"] for r in rows if "loss" in r]
    assert len(losses[1]) == 4
    for sp, ref in zip(losses[4], losses[1], strict=True):
        assert abs(sp - ref) <= 1e-5 * abs(ref), losses


def test_the_docs_example_runs_as_written(capsys):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "balance.md").read_text()
    example = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "pack_by_degree" in b]
    exec(example[0], {})
    printed = capsys.readouterr().out
    assert "['attention_mask', 'input_ids', 'labels', 'position_ids']" in printed, printed


def _bench_rows() -> list[dict]:
    from benchmarks.bench_dynamic import run_system

    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(4, 100, (n,), generator=g) for n in [12, 30, 7, 90, 180, 25, 60, 40, 200, 15] * 3]
    return [run_system(name, docs, 256) for name in ("default", "balanced+dynamic")]


def test_the_length_mix_benchmark_runs_every_degree(dist_pool):
    """benchmarks/bench_dynamic.py on 2 ranks: fixed rows at the whole group; balanced rows of whole
    documents at p = 1 where they are short, every document's tokens trained once."""
    default, dynamic = dist_pool(2).run(_bench_rows)[0]
    assert default["degrees"] == f"p=2: {default['steps']}" and default["padding_pct"] == 0.0
    assert (
        "p=1:" in dynamic["degrees"]
        and dynamic["tokens"] == sum([12, 30, 7, 90, 180, 25, 60, 40, 200, 15]) * 3 + 30
    )
    assert all(r["tokens_per_s"] > 0 and r["mean_loss"] > 0 for r in (default, dynamic))
