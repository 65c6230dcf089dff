"""train.py --resume on another world size: DeepSpeed's universal checkpoint, data position in samples."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from ds_seqpar.checkpoint_resume import SampleHistory, convert_to_universal, saved_world_size
from ds_seqpar.cli import DEFAULT_CONFIG, main

COMMON = ["--seq-len", "256", "--curriculum", "none", "--eval-every", "0", "--eval-samples", "1"]
COMMON += ["--no-progress", "--no-export", "--ds_config", str(DEFAULT_CONFIG)]


def run_cli(argv: list[str]) -> list[dict]:
    """train.py's main on this rank; rank 0's metrics rows."""
    main(argv)
    dist.barrier()
    out = argv[argv.index("--output-dir") + 1]
    return [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]


def _losses(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _rewound(out: Path, step: int, to: Path) -> Path:
    """A new output dir holding only ``out``'s checkpoint of ``step`` as the latest (DeepSpeed's
    ``latest`` file names the tag), as if that run had stopped there: one run gives both the
    checkpoint and the uninterrupted reference losses."""
    shutil.copytree(out / "checkpoints" / f"step{step}", to / "checkpoints" / f"step{step}")
    (to / "checkpoints" / "latest").write_text(f"step{step}")
    return to


def test_sample_history_keeps_the_data_position_in_samples():
    """2 steps at 2 samples per step (dp 2), then 1 per step (dp 1), then 4 (dp 4)."""
    history = SampleHistory.fresh(2).continued(2, 1)
    assert history.segments == ((0, 2), (2, 1))
    assert history.samples(0, 2) == 4 and history.samples(0, 4) == 6 and history.samples(1, 3) == 3
    assert history.skip(0, 2, 1) == 4  # dp 1 continues at sample 4
    assert history.skip(1, 2, 1) == 2  # a curriculum phase that began at step 1 has used 2 of its samples
    later = history.continued(3, 4)
    assert later.segments == ((0, 2), (2, 1), (3, 4)) and later.rate(5) == 4
    assert later.skip(0, 3, 4) == 2  # 5 samples used: rounded up, none is trained on twice
    assert history.continued(2, 2).segments == ((0, 2),)  # back to the old rate: one segment
    assert SampleHistory.from_state(later.to_state()) == later
    assert SampleHistory.fresh(3).skip(0, 5, 3) == 5  # same world: batches = steps, as before


def test_a_failed_conversion_names_the_converter(tmp_path):
    (tmp_path / "step1").mkdir()
    with pytest.raises(RuntimeError, match=r"DeepSpeed's ds_to_universal failed on .*step1"):
        convert_to_universal(tmp_path / "step1", tmp_path / "step1_universal")
    assert not (tmp_path / "step1_universal").exists() and not (tmp_path / "step1_universal.partial").exists()


def test_resume_on_two_ranks_from_a_four_rank_checkpoint(dist_pool, tmp_path):
    """Save at step 2 on 4 ranks (ZeRO-3, U2 x R2), resume on 2 (``--sp-size 2``, U2): the checkpoint is
    converted to a universal one, the step continues from 2, and steps 3 and 4 give the uninterrupted
    4-rank run's losses (so the weights, Adam moments and data position were restored)."""
    pool4 = dist_pool(4)
    argv = [*COMMON, "--max-steps", "4", "--save-every", "2", "--output-dir", str(tmp_path / "full")]
    full = pool4.run(run_cli, argv)[0]
    pool4.close()  # one multi-rank job at a time
    split = _rewound(tmp_path / "full", 2, tmp_path / "split")
    assert saved_world_size(split / "checkpoints" / "step2") == 4
    argv = [*COMMON, "--sp-size", "2", "--max-steps", "4", "--resume", "--output-dir", str(split)]
    resumed = dist_pool(2).run(run_cli, argv)[0]
    universal = split / "checkpoints" / "step2_universal"
    assert (universal / "zero" / "optimizer_state.pt").is_file()
    assert (split / "checkpoints" / "latest_universal").read_text() == "step2_universal"
    assert (split / "checkpoints" / "latest").read_text() == "step4"  # saved by the 2-rank run
    assert saved_world_size(split / "checkpoints" / "step4") == 2
    before = _losses(full)
    after = _losses(resumed)
    assert sorted(after) == [3, 4] and all(math.isfinite(v) for v in after.values()), resumed
    for step in (3, 4):
        assert after[step] == pytest.approx(before[step], rel=1e-5, abs=1e-6), (after, before)


@pytest.mark.slow
def test_resume_on_a_smaller_data_parallel_size_skips_the_samples_trained_on(dist_pool, tmp_path):
    """4 ranks as dp 2 x sp 2 train 2 steps (4 samples); 2 ranks (dp 1 x sp 2) resume at sample 4: their
    step-3 loss is the 4-rank run's rank-0 loss at step 3, which trains on sample 4 too."""
    common = [*COMMON, "--sp-size", "2"]
    pool4 = dist_pool(4)
    argv = [*common, "--max-steps", "3", "--save-every", "2", "--output-dir", str(tmp_path / "full")]
    full = pool4.run(run_cli, argv)[0]
    pool4.close()
    split = _rewound(tmp_path / "full", 2, tmp_path / "split")
    argv = [*common, "--max-steps", "4", "--resume", "--output-dir", str(split)]
    after = _losses(dist_pool(2).run(run_cli, argv)[0])
    assert sorted(after) == [3, 4] and math.isfinite(after[4])
    assert after[3] == pytest.approx(_losses(full)[3], rel=1e-5, abs=1e-6)
