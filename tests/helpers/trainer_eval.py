"""SeqParTrainer's sharded evaluation vs a single-process token-weighted evaluation (tests/test_hf_integration.py).

The reference runs the plain HF model on every sample in one process (packed documents one forward
each) and sums cross-entropy, correct argmax and labelled tokens over the whole set; the eval set has
an odd number of samples, so dp = 2 runs filler batches, and mixes packed and plain rows.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from tests.helpers.hf_ab import ab_ds_config
from tests.helpers.hf_models import batches, tiny_model

SEQ = 40  # not a multiple of the layouts' 2 x 4: shard_batch pads


def eval_samples(n: int, seed: int, short: int = SEQ) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of SEQ tokens; every other row packs 3 documents (positions restart, labels -100 at a
    document's first token, as ds_seqpar.tasks.text.pack_documents); the rows between them plain and cut
    to ``short`` tokens."""
    out = []
    for i, b in enumerate(batches(n, 1, SEQ, seed=seed)):
        ids = b["input_ids"][0]
        labels = ids.clone()
        pos = torch.arange(SEQ)
        if i % 2 == 0:
            starts = (0, 11, 29)
            for a, z in itertools.pairwise((*starts, SEQ)):
                pos[a:z] = torch.arange(z - a)
            labels[list(starts)] = -100
        keep = SEQ if i % 2 == 0 else short
        out.append({"input_ids": ids[:keep], "labels": labels[:keep], "position_ids": pos[:keep]})
    return out


def reference(model: torch.nn.Module, samples: list[dict], use_labels: bool = True) -> dict[str, float]:
    """Token-weighted loss and next-token accuracy over ``samples`` in one process."""
    loss_sum, correct, count = 0.0, 0, 0
    for s in samples:
        ids, pos = s["input_ids"], s["position_ids"]
        labels = s["labels"] if use_labels else ids
        n = len(ids)
        starts = [0, *(i for i in range(1, n) if pos[i] <= pos[i - 1]), n]
        with torch.no_grad():
            logits = torch.cat(
                [model(input_ids=ids[a:z][None]).logits[0] for a, z in itertools.pairwise(starts)]
            )
        targets = torch.nn.functional.pad(labels[1:], (0, 1), value=-100)
        keep = targets != -100
        logits, targets = logits[keep].double(), targets[keep]
        loss_sum += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        correct += int((logits.argmax(-1) == targets).sum())
        count += int(keep.sum())
    return {"loss": loss_sum / count, "accuracy": correct / count, "count": count}


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def _without_labels(examples: list[dict]) -> dict[str, torch.Tensor]:
    """A collator that drops the labels (shard_batch then predicts the input ids): fillers must still count 0."""
    return {k: torch.stack([e[k] for e in examples]) for k in ("input_ids", "position_ids")}


def _trainer(kind: str, sp: int, u: int, stage: int, layout: str, out_dir: str, **kwargs: Any) -> Any:
    from transformers import TrainingArguments

    import ds_seqpar

    config = ab_ds_config(sp, u, stage, layout)
    config["zero_optimization"].update(kwargs.pop("zero", {}))
    config["gradient_clipping"] = 1.0
    del config["zero_allow_untested_optimizer"]
    collator = kwargs.pop("data_collator", None)
    eval_dataset = kwargs.pop("eval_dataset")
    chunk = kwargs.pop("loss_chunk_size", 1024)
    args = TrainingArguments(
        output_dir=out_dir, deepspeed=config, max_grad_norm=1.0, report_to=[], use_cpu=True, seed=0,
        save_strategy="no", learning_rate=0.0, max_steps=1, logging_steps=1, **kwargs,
    )  # fmt: skip
    train = _Rows(eval_samples(2, seed=3))
    return ds_seqpar.SeqParTrainer(
        model=tiny_model(kind),
        args=args,
        train_dataset=train,
        eval_dataset=eval_dataset,
        data_collator=collator,
        loss_chunk_size=chunk,
    )


def trainer_eval_case(kind: str, sp: int, u: int, stage: int, layout: str, out_dir: str) -> dict[str, Any]:
    """``trainer.evaluate()`` before training, and the evaluations ``eval_strategy='steps'`` runs during a
    1-step training at lr 0 (the DeepSpeed engine, weights unchanged), vs the reference."""
    dp2 = sp < 4
    plain, packed = eval_samples(5, seed=11, short=24 if dp2 else SEQ), eval_samples(3, seed=12)
    kwargs: dict[str, Any] = dict(
        per_device_eval_batch_size=2 if dp2 else 1, eval_strategy="steps", eval_steps=1
    )
    if dp2:  # one eval set, a collator without labels; replica 0 reads 40-token rows, replica 1 24-token ones
        # and the filler: 16-token logits chunks make their head calls differ (3 vs 2 in the first batch), which
        # ZeRO-3 with every parameter partitioned (persistence threshold 0) gathers per call
        kwargs.update(
            eval_dataset=_Rows(plain),
            data_collator=_without_labels,
            loss_chunk_size=16,
            zero={"stage3_param_persistence_threshold": 0},
        )
    else:  # a dict of eval sets: eval_<name>_loss
        kwargs.update(eval_dataset={"plain": _Rows(plain), "packed": _Rows(packed)})
    trainer = _trainer(kind, sp, u, stage, layout, out_dir, **kwargs)
    mode = trainer.model.training
    before = trainer.evaluate()
    assert trainer.model.training == mode
    trainer.train()
    during: dict[int, dict] = {}  # one log row per eval set: merged per step
    for row in trainer.state.log_history:
        if any(k.startswith("eval") and k.endswith("_loss") for k in row):
            during.setdefault(row["step"], {}).update(row)
    ref_model = tiny_model(kind)
    refs = {"eval": reference(ref_model, plain, use_labels=not dp2)}
    if not dp2:
        refs = {"eval_plain": refs["eval"], "eval_packed": reference(ref_model, packed)}
    return {"before": before, "during": list(during.values()), "refs": refs}


def sft_eval_case(out_dir: str) -> dict[str, Any]:
    """TRL's ``SFTTrainer`` through ``with_sequence_parallel`` (packing: padding-free rows of documents, the
    eval set prepared by TRL): ``evaluate()`` before ``train()``, on a model that ``from_config`` partitioned
    (ZeRO-3 config alive: ``deepspeed.zero.Init``), vs the reference on the rows its collator makes."""
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    import ds_seqpar

    asset = "assets/tiny-llama"
    tokenizer = AutoTokenizer.from_pretrained(asset)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(asset), dtype=torch.float32)

    g = torch.Generator().manual_seed(5)
    texts = [
        " ".join(f"f{int(i)}" for i in torch.randint(0, 60, (int(n),), generator=g))
        for n in (20, 45, 33, 50, 27, 38)
    ]
    config = ab_ds_config(4, 2, 3)
    config["gradient_clipping"] = 1.0
    del config["zero_allow_untested_optimizer"]
    args = SFTConfig(
        output_dir=out_dir, deepspeed=config, max_grad_norm=1.0, report_to=[], use_cpu=True, bf16=False,
        packing=True, max_length=64, per_device_eval_batch_size=1,
    )  # fmt: skip
    data = Dataset.from_dict({"text": texts})
    trainer = ds_seqpar.with_sequence_parallel(SFTTrainer)(
        model=model(), args=args, train_dataset=data, eval_dataset=data, processing_class=tokenizer
    )
    got = trainer.evaluate()
    rows = []
    for i in range(len(trainer.eval_dataset)):
        batch = trainer.data_collator([trainer.eval_dataset[i]])
        rows.append({k: batch[k][0] for k in ("input_ids", "labels", "position_ids")})
    import deepspeed

    ref_model = model()  # built under deepspeed.zero.Init like the trainer's (ZeRO-3 config alive): gather it
    with deepspeed.zero.GatheredParameters(list(ref_model.parameters())):
        ref = reference(ref_model, rows)
    return {"before": got, "during": [], "refs": {"eval": ref}, "rows": len(rows)}


def masked_trainer_eval_case(out_dir: str) -> dict[str, Any]:
    """A masked-LM encoder (ModernBERT: local and global layers) through SeqParTrainer (SeqParMaskedLM):
    ``evaluate()`` vs the one-process masked-token loss and accuracy (labels not shifted)."""
    from tests.helpers.hf_models import masked_batches

    rows = [{k: v[0] for k, v in b.items()} for b in masked_batches(3, 1, SEQ, seed=21)]
    trainer = _trainer("modernbert", 4, 2, 1, "zigzag", out_dir, eval_dataset=_Rows(rows))
    got = trainer.evaluate()
    model = tiny_model("modernbert")
    loss_sum, correct, count = 0.0, 0, 0
    for row in rows:
        with torch.no_grad():
            logits = model(input_ids=row["input_ids"][None]).logits[0].double()
        keep = row["labels"] != -100
        logits, targets = logits[keep], row["labels"][keep]
        loss_sum += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        correct += int((logits.argmax(-1) == targets).sum())
        count += int(keep.sum())
    return {
        "before": got,
        "during": [],
        "refs": {"eval": {"loss": loss_sum / count, "accuracy": correct / count}},
    }
