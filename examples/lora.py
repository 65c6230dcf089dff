"""LoRA fine-tuning (PEFT) under sequence parallelism with ``ds_seqpar.initialize`` and your own loop.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 examples/lora.py --ds_config ds_configs/usp_zero3.json

The PEFT wrapper is passed as it is: ds_seqpar routes the attention of the HF model it adapts and
trains the wrapper, so only the adapters get gradients and optimizer state. The JSON's optimizer
sees only the trainable (adapter) parameters.
"""

from __future__ import annotations

import sys

import torch.distributed as dist
from common import example_parser, load_model, load_tokenizer, passkey_dataset, report_losses
from peft import LoraConfig, get_peft_model

import ds_seqpar


def main(argv: list[str] | None = None) -> list[float]:
    """Train ``--max-steps`` steps; returns the loss of every step."""
    args = example_parser(__doc__.splitlines()[0], "outputs/example_lora").parse_args(argv)
    model = get_peft_model(
        load_model(args.model, args.seed),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, loader, _ = ds_seqpar.initialize(
        model=model,  # the PEFT wrapper itself
        config=args.ds_config,  # the shipped JSON as it is
        model_parameters=trainable,
        training_data=passkey_dataset(load_tokenizer(args.model), args.seq_len, args.seed),
        seed=args.seed,
    )
    losses: list[float] = []
    for batch in loader:  # this rank's shard of each batch
        loss = engine(**batch)  # the whole SP group's token-mean loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if len(losses) == args.max_steps:
            break
    if dist.get_rank() == 0:
        print(
            f"examples/lora.py: {sum(p.numel() for p in trainable)} trainable (adapter) parameters",
            flush=True,
        )
    return report_losses("lora.py", losses, dist.get_rank() == 0)


if __name__ == "__main__":
    main(sys.argv[1:])
