"""Your own training loop under ``accelerate launch`` with the DeepSpeed plugin and sequence parallelism.

    .venv/bin/accelerate launch --num_processes 4 --use_deepspeed \\
        --deepspeed_config_file ds_configs/usp_zero3.json examples/accelerate_loop.py

(on CPU set ``OMP_NUM_THREADS=1`` and do not pass ``--cpu``: accelerate refuses it with ``--use_deepspeed``). The ``"sequence_parallel"`` section of the JSON
that accelerate's plugin carries configures ds_seqpar; ``ds_seqpar.accelerate_prepare`` replaces
``accelerator.prepare``. accelerate's own ``ParallelismConfig`` may state the SP size (``sp_size``;
see docs/integration.md); its CP / TP sizes must stay unset.
"""

from __future__ import annotations

import sys

from accelerate import Accelerator
from common import (
    example_parser,
    load_model,
    load_tokenizer,
    passkey_dataset,
    report_losses,
    start_distributed,
)

import ds_seqpar


def main(argv: list[str] | None = None) -> list[float]:
    """Train ``--max-steps`` steps; returns the loss of every step."""
    args = example_parser(__doc__.splitlines()[0], "outputs/example_accelerate").parse_args(argv)
    start_distributed(args.ds_config)  # before TrainingArguments / Accelerator; the launcher's environment
    accelerator = Accelerator()  # the DeepSpeed plugin comes from `accelerate launch --use_deepspeed ...`
    model = load_model(args.model, args.seed)
    dataset = passkey_dataset(load_tokenizer(args.model), args.seq_len, args.seed)
    # the shipped JSON has an "optimizer": accelerate's DummyOptim stands for it (pass a torch optimizer otherwise)
    engine, optimizer, loader = ds_seqpar.accelerate_prepare(
        accelerator, model, train_dataset=dataset, seed=args.seed
    )
    losses: list[float] = []
    for batch in loader:
        loss = engine(**batch)  # this rank's shard in, the whole SP group's token-mean loss out
        accelerator.backward(loss)  # DeepSpeed's backward and optimizer step
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        accelerator.print(f"step {len(losses)}: loss {losses[-1]:.4f}")
        if len(losses) == args.max_steps:
            break
    return report_losses("accelerate_loop.py", losses, accelerator.is_main_process)


if __name__ == "__main__":
    main(sys.argv[1:])
