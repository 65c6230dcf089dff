"""ALiBi families (BLOOM, MPT) under ds_seqpar equal the plain model: their attentions compute scores
themselves, so ``integrations/attention_layers.py`` routes them through the attention interface with
``alibi_slopes``, which the kernels apply from GLOBAL positions (docs/kernels.md "ALiBi").

Tiny float32 models from ``benchmarks/tiny_configs.py``, 4 gloo ranks: one forward/backward over meshes,
layouts, padding and packed documents (the SP ranks' gradients sum to the plain gradient), and
``ds_seqpar.initialize`` with ZeRO-3 for 5 SGD steps (losses and gathered gradients).
"""

from __future__ import annotations

import pytest
import torch

from ds_seqpar.integrations.alibi_adapters import _mpt_slopes
from ds_seqpar.integrations.attention_layers import (
    IMPL_ATTR,
    route_attention_layers,
    unroute_attention_layers,
)
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from tests.helpers.hf_ab import deepspeed_ab, sp_vs_reference
from tests.helpers.hf_models import batches, tiny_model


def _padded(seq_len: int, real: int) -> dict:
    batch = batches(1, 2, seq_len)[0]
    batch["attention_mask"] = torch.ones(2, seq_len, dtype=torch.long)
    batch["attention_mask"][1, real:] = 0  # row 1: end padding
    return batch


def _packed(lengths: list[int]) -> dict:
    batch = batches(1, 1, sum(lengths))[0]
    batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
    return batch


CASES = [
    ("bloom", 2, "zigzag", batches(1, 2, 64)[0]),  # U 2 x R 2
    ("bloom", 1, "contiguous", _padded(64, 41)),  # pure ring, end padding
    ("bloom", 2, "documents", _packed([3, 40, 5, 9, 7])),  # packed documents, placed whole
    ("mpt", 2, "zigzag", batches(1, 2, 62)[0]),  # 62 tokens: padded to the layout's multiple
    ("mpt", 4, "zigzag", _packed([21, 30, 13])),  # pure Ulysses
]


@pytest.mark.parametrize(
    ("kind", "u", "layout", "batch"), CASES, ids=lambda x: x if isinstance(x, str | int) else ""
)
def test_forward_backward_equals_plain_model(dist_pool, kind, u, layout, batch):
    for rep in dist_pool(4).run(sp_vs_reference, kind, u, layout, batch):
        assert rep["finite"], rep
        assert rep["loss_err"] <= 1e-5, rep
        assert rep["grad_rel_err"] <= 1e-5, rep


@pytest.mark.parametrize("kind", ["bloom", pytest.param("mpt", marks=pytest.mark.slow)])
def test_zero3_training_matches_plain_model(dist_pool, kind):
    for rep in dist_pool(4).run(deepspeed_ab, kind, 4, 2, 3, 5, 64, 0.5):
        assert max(rep["loss_errs"]) <= 1e-5, rep
        assert rep["grad_err"] <= 1e-5, rep


def test_routing_is_undone_and_the_family_forward_runs_again():
    model = tiny_model("bloom")
    ids = batches(1, 1, 12)[0]["input_ids"]
    with torch.no_grad():
        before = model(input_ids=ids).logits
    assert route_attention_layers(model, "ds_seqpar_probe") == model.config.n_layer
    unroute_attention_layers(model)
    assert not any(IMPL_ATTR in m.__dict__ or "forward" in m.__dict__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_mpt_bias_table_must_be_alibi():
    slopes = torch.tensor([0.5, 0.25])
    table = (torch.arange(-7, 1, dtype=torch.int32) * slopes[:, None]).unsqueeze(1)  # [H, 1, L]
    assert torch.equal(_mpt_slopes("m", table), slopes)
    with pytest.raises(UnsupportedModelError, match="not a per-head linear"):
        _mpt_slopes("m", table + torch.rand(2, 1, 8))


def test_falcon_alibi_in_its_mask_is_refused_by_name():
    import transformers

    from benchmarks.tiny_configs import tiny_config
    from ds_seqpar.integrations.attention_layers import refuse_unrouted_alibi

    config = tiny_config("falcon")
    refuse_unrouted_alibi(
        transformers.AutoModelForCausalLM.from_config(config)
    )  # rotary: runs (the sweep: exact)
    config.alibi = True
    with pytest.raises(UnsupportedModelError, match=r"config.alibi=True adds ALiBi to the attention mask"):
        refuse_unrouted_alibi(transformers.AutoModelForCausalLM.from_config(config))
