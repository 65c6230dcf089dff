"""HF models whose recurrent layers ds_seqpar routes (GDN, KDA, Mamba2, Mamba v1, short convs, ZAYA's convolved
projections) equal the plain model.

Tiny float32 models from ``benchmarks/tiny_configs.py`` (softmax layers through the ``"ds_seqpar"``
attention, recurrent layers through the registry's adapters), 4 gloo ranks: one forward/backward over
meshes and layouts (the SP ranks' gradients sum to the plain gradient; 62 tokens = end padding), and
``ds_seqpar.initialize`` with ZeRO-3 for 5 SGD steps (losses and gathered gradients).
"""

from __future__ import annotations

import pytest
import torch

import ds_seqpar
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.integrations.recurrent_layers import REGISTRY, adapter_for, route_recurrent_layers
from tests.helpers.hf_ab import deepspeed_ab, sp_vs_reference
from tests.helpers.hf_models import HYBRID_MODELS, batches

# the others: slow suite
DEFAULT_ZERO3 = (
    "qwen3_next",
    "kimi_linear",
    "nemotron_h",
    "bamba",
    "olmo_hybrid",
    "lfm2",
    "mamba",
    "recurrent_gemma",
)
CASES = [
    ("qwen3_next", 2, "zigzag", 64),  # GDN, GVA (value heads > key heads)
    ("qwen3_5", 1, "contiguous", 62),
    ("kimi_linear", 2, "zigzag", 62),  # KDA: per-channel decay
    ("nemotron_h", 1, "zigzag", 64),  # Mamba2 + MoE + attention + MLP-only layers
    ("bamba", 2, "contiguous", 64),
    ("granitemoehybrid", 2, "zigzag", 64),
    ("zamba2", 2, "zigzag", 64),  # one Mamba2 head < U: split along head_dim
    ("olmo_hybrid", 2, "zigzag", 62),  # GDN with allow_neg_eigval (beta in [0, 2]), g_proj gate
    ("bailing_hybrid", 2, "contiguous", 64),  # KDA with the safe (bounded sigmoid) forget gate
    ("lfm2", 2, "zigzag", 62),  # gated short conv: the conv halo only, no scan
    ("zaya", 2, "zigzag", 62),  # q/k convolutions and the value shift: halos over zigzag runs, end padding
    ("zaya", 1, "stripe", 64),  # R 4, stripes of one token: every halo row from another rank
    ("recurrent_gemma", 2, "zigzag", 62),  # RG-LRU (diagonal scan) + conv1d halo + sliding attention
    ("rwkv", 2, "contiguous", 64),  # token shifts (one halo row) + WKV (exclusive diagonal scan)
    ("xlstm", 2, "zigzag", 62),  # mLSTM: max-stabiliser (gathered max-plus maps) + C / n state All-Scan
]
STRONG_DT = dict(time_step_min=0.2, time_step_max=0.5)  # Mamba v1: dt·B·x well above the D skip
MAMBA_CASES = [
    ("mamba", 2, "zigzag", 62, STRONG_DT),  # Mamba v1, end padding
    ("falcon_mamba", 1, "contiguous", 64, STRONG_DT),  # weightless RMS norms on dt, B, C
    ("jamba", 2, "contiguous", 62, {}),  # dt / B / C RMS norms with weights; attention + MoE layers
    ("zamba", 2, "zigzag", 64, STRONG_DT),  # two Mamba heads: per-head x_proj / dt_proj, B and C
    ("mamba2", 2, "zigzag", 62, {}),
    (  # muP multipliers on the mixer's input and on each section of in_proj, gated RMSNorm on
        "falcon_h1",
        2,
        "zigzag",
        64,
        dict(
            ssm_in_multiplier=0.6,
            ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.7],
            ssm_out_multiplier=1.3,
            mamba_rms_norm=True,
            mamba_norm_before_gate=False,
            mamba_d_ssm=128,  # smaller than the sweep's tiny mixer: 16 heads of 8, state 16
            mamba_n_heads=16,
            mamba_d_state=16,
        ),
    ),
]


@pytest.mark.parametrize(("kind", "u", "layout", "seq_len"), CASES)
def test_forward_backward_equals_plain_model(dist_pool, kind, u, layout, seq_len):
    batch = batches(1, 2, seq_len)[0]
    for rep in dist_pool(4).run(sp_vs_reference, kind, u, layout, batch):
        assert rep["finite"], rep
        assert rep["loss_err"] <= 1e-5, rep
        assert rep["grad_rel_err"] <= 1e-5, rep


@pytest.mark.parametrize(("kind", "u", "layout", "seq_len", "overrides"), MAMBA_CASES)
def test_mamba_mixers_equal_plain_model(dist_pool, kind, u, layout, seq_len, overrides):
    batch = batches(1, 2, seq_len)[0]
    for rep in dist_pool(4).run(sp_vs_reference, kind, u, layout, batch, overrides):
        assert rep["finite"], rep
        assert rep["loss_err"] <= 1e-5, rep
        assert rep["grad_rel_err"] <= 1e-5, rep


ZERO3 = [(kind, 2) for kind in HYBRID_MODELS]  # U 2 x R 2
R4_ZERO3 = ("olmo_hybrid", "lfm2", "mamba", "recurrent_gemma", "rwkv", "xlstm", "zaya")
ZERO3 += [(kind, 1) for kind in R4_ZERO3]  # and R 4


@pytest.mark.parametrize(
    ("kind", "u"), [c if c[0] in DEFAULT_ZERO3 else pytest.param(*c, marks=pytest.mark.slow) for c in ZERO3]
)
def test_zero3_training_matches_plain_model(dist_pool, kind, u):
    for rep in dist_pool(4).run(deepspeed_ab, kind, 4, u, 3, 5, 64, 0.5):
        assert max(rep["loss_errs"]) <= 1e-5, rep
        assert rep["grad_err"] <= 1e-5, rep


class TinyShortConv(torch.nn.Module):
    """A recurrent layer kind no adapter covers (its name ends like LFM2's)."""


class TinyRecurrence(torch.nn.Module):
    def forward(self, x):
        return x


def test_registry_routes_by_class_and_refuses_the_rest_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), TinyShortConv())
    with pytest.raises(
        UnsupportedModelError, match=r"Sequential\.1 is a TinyShortConv.*register_recurrent_layer"
    ):
        route_recurrent_layers(model)
    routed = lambda self, x: 2 * x  # noqa: E731 - a stand-in adapter
    ds_seqpar.register_recurrent_layer(TinyRecurrence, routed)
    try:
        layer = TinyRecurrence()
        assert adapter_for(layer) is routed
        assert route_recurrent_layers(torch.nn.Sequential(layer)) == 1
        assert layer(torch.ones(1)).item() == 2.0
    finally:
        del REGISTRY[TinyRecurrence]
    with pytest.raises(TypeError, match=r"takes an nn\.Module subclass"):
        ds_seqpar.register_recurrent_layer(object, routed)


def test_the_registration_snippet_of_the_docs_runs():
    """docs/delta.md's python block runs as written and registers its class."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "delta.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    scope: dict = {"__name__": "delta_doc"}
    exec(compile(block, "docs/delta.md", "exec"), scope)
    try:
        assert adapter_for(scope["MyRecurrence"]()) is scope["my_forward"]
    finally:
        del REGISTRY[scope["MyRecurrence"]]


def rwkv_with_extreme_keys() -> str:
    """A tiny RWKV whose time_first puts a token's bonus weight below float64's range after the WKV's shift."""
    from ds_seqpar import SeqParCausalLM, shard_batch
    from tests.helpers.hf_ab import sp_mesh
    from tests.helpers.hf_models import tiny_model

    model = tiny_model("rwkv")
    with torch.no_grad():
        model.rwkv.blocks[1].attention.time_first.fill_(-1000.0)
    mesh = sp_mesh(2)
    sp = SeqParCausalLM(model, mesh)
    try:
        sp(**shard_batch(batches(1, 2, 64)[0], mesh))
    except UnsupportedModelError as exc:
        return str(exc)
    return "no error"


def test_rwkv_refuses_keys_beyond_the_wkv_range_on_every_rank(dist_pool):
    for message in dist_pool(4).run(rwkv_with_extreme_keys):
        assert "RwkvSelfAttention (layer 1): its keys span" in message, message
