"""Bad input is refused before any collective starts, with an error that names the value and the fix.

Every case runs on a rank of a 2-rank gloo group with every torch.distributed collective and
point-to-point call replaced by a tripwire: a case passes only if it raises the expected error
*and* no communication was attempted (a half-started collective is what turns bad input into a hang).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar import SeqParMesh, shard_batch
from ds_seqpar.config import load_config, parse_section
from ds_seqpar.layout import doc_ids_from_cu_seqlens
from ds_seqpar.parallel.linear_scan import linear_attention
from tests.helpers.meshes import mesh_for

COMM = [
    "all_to_all_single", "all_to_all", "all_reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter_tensor", "broadcast", "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
]  # fmt: skip


class CollectiveStarted(AssertionError):
    pass


@contextmanager
def _tripwire():
    saved = {name: getattr(dist, name) for name in COMM}

    def trip(name: str) -> Callable:
        def called(*args, **kwargs):
            raise CollectiveStarted(f"torch.distributed.{name} was called before the input was validated")

        return called

    for name in COMM:
        setattr(dist, name, trip(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _mesh(u: int = 2, layout: str | None = "zigzag", attention: str = "usp", **extra) -> SeqParMesh:
    ring = {} if layout is None else {"ring": {"layout": layout}}
    return mesh_for({"size": 2, "ulysses_degree": u, "attention": attention, **ring, **extra})


def _qkv(n: int = 8, h: int = 4, h_kv: int = 4, d: int = 8, dtype=torch.float32) -> tuple[torch.Tensor, ...]:
    return (
        torch.randn(1, n, h, d, dtype=dtype),
        torch.randn(1, n, h_kv, d, dtype=dtype),
        torch.randn(1, n, h_kv, d, dtype=dtype),
    )


# ---------------------------------------------------------------------------------------------- cases
# name -> (the bad call, a regex the message must match: the offending value and the fix)


def _attn(**kw):
    q, k, v = kw.pop("qkv", None) or _qkv()
    return ds_seqpar.attention(q, k, v, mesh=kw.pop("mesh", None) or _mesh(), **kw)


def _bad_heads():
    q, k, v = _qkv(h=4, h_kv=3)
    return ds_seqpar.attention(q, k, v, mesh=_mesh())


def _u_above_heads():
    q, k, v = _qkv(h=1, h_kv=1)
    return ds_seqpar.attention(q, k, v, mesh=_mesh(u=2))


def _shard_batch(batch: dict):
    return shard_batch(batch, _mesh())


def _linear(**kw):
    q, k, v = _qkv()
    return linear_attention(q, k, v, mesh=_mesh(u=1, layout=kw.pop("layout", "contiguous")), **kw)


def _lm(**batch_overrides):
    from ds_seqpar import SeqParCausalLM
    from tests.helpers.hf_models import tiny_model

    model = SeqParCausalLM(tiny_model("llama"), _mesh(u=1))
    batch = shard_batch({"input_ids": torch.randint(4, 50, (1, 16))}, model.mesh)
    return model(**{**batch, **batch_overrides})


def _decoder_keyword(**kwargs):
    """A keyword the model forwards to its attention layers (transformers passes **kwargs through)."""
    from ds_seqpar import SeqParCausalLM
    from ds_seqpar.integrations.context import CONTEXT_KEY, SeqParContext
    from tests.helpers.hf_models import tiny_model

    lm = SeqParCausalLM(tiny_model("llama"), _mesh(u=1))
    batch = shard_batch({"input_ids": torch.randint(4, 50, (1, 16))}, lm.mesh)
    ctx = SeqParContext(lm.mesh)
    return lm.model.get_decoder()(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], **{CONTEXT_KEY: ctx}, **kwargs
    )


def _attention_call(**kwargs):
    """transformers' attention interface call, as an attention layer makes it."""
    from ds_seqpar.integrations.context import CONTEXT_KEY, SeqParContext
    from ds_seqpar.integrations.hf_attention import seqpar_attention_forward

    q, k, v = (t.transpose(1, 2) for t in _qkv())
    layer = torch.nn.Module()
    layer.layer_idx = 3
    mask = kwargs.pop("attention_mask", None)
    return seqpar_attention_forward(layer, q, k, v, mask, **{CONTEXT_KEY: SeqParContext(_mesh())}, **kwargs)


def _moe_aux_loss():
    from ds_seqpar import SeqParCausalLM
    from tests.helpers.hf_models import tiny_model

    return SeqParCausalLM(tiny_model("gpt_oss", output_router_logits=True), _mesh(u=1))


CASES: dict[str, tuple[Callable[[], object], str]] = {
    "attention_keyword_from_the_model": (lambda: _decoder_keyword(relative_bias=torch.zeros(1, 4, 16, 16)), r"LlamaAttention \(layer 0\) passed relative_bias=<tensor \(1, 4, 16, 16\).*honours dropout, scaling, sliding_window, softcap, s_aux, alibi_slopes, is_causal"),
    "attention_position_bias": (lambda: _decoder_keyword(position_bias=torch.zeros(1, 4, 16, 16)), r"passed position_bias=<tensor \(1, 4, 16, 16\).*: an additive \[B, H, S, S\] score bias.*return its gradient"),
    "attention_keyword_varlen": (lambda: _attention_call(cu_seq_lens_q=torch.tensor([0, 8])), r"\(layer 3\) passed cu_seq_lens_q=<tensor \(2,\) torch.int64>"),
    "attention_mask_reaches_attention": (lambda: _attention_call(attention_mask=torch.zeros(1, 1, 8, 8)), r"passed attention_mask of shape \(1, 1, 8, 8\).*cannot honour an explicit mask"),
    "attention_sinks_wrong_size": (lambda: _attention_call(s_aux=torch.zeros(3)), r"s_aux=<tensor \(3,\).*one logit per query head \(4 values\)"),
    "sinks_wrong_shape": (lambda: _attn(sinks=torch.zeros(3)), r"sinks must be a float tensor \[H\].*H=4\); got \(3,\)"),
    "softcap_negative": (lambda: _attn(softcap=-1.0), r"softcap=-1.0 is invalid: use a number > 0"),
    "alibi_slopes_wrong_shape": (lambda: _attn(alibi_slopes=torch.ones(3)), r"alibi_slopes must be a float tensor \[H\] \(H=4\); got \(3,\)"),
    "alibi_with_sparse_ring": (lambda: _attn(mesh=_mesh(u=1, layout=None, attention="sparse_ring", sparse={"block_size": 4}), alibi_slopes=torch.ones(4)), r"alibi_slopes with attention='sparse_ring': the sparse block kernels take no position bias"),
    "softcap_with_sdpa_kernel": (lambda: _attn(mesh=_mesh(kernel="sdpa"), softcap=2.0), r"kernel='sdpa' cannot apply softcap=2.0.*valid here .*auto, torch"),
    "model_input_not_text": (lambda: _lm(pixel_values=torch.zeros(1, 3, 8, 8)), r"got inputs \['pixel_values'\].*token ids only"),
    "moe_router_aux_loss": (_moe_aux_loss, r"output_router_logits=True adds the MoE load-balancing loss.*set model.config.output_router_logits=False"),
    "position_ids_local_not_global": (lambda: _lm(position_ids=torch.arange(8)[None]), r"not the global positions.*shard_batch"),
    "position_ids_missing": (lambda: _lm(position_ids=None), r"position_ids is missing"),
    "attention_mask_4d": (lambda: _lm(attention_mask=torch.ones(1, 1, 16, 16)), r"attention_mask of shape \(1, 1, 16, 16\) cannot be honoured"),
    "q_not_4d": (lambda: _attn(qkv=(torch.randn(8, 4, 8), torch.randn(1, 8, 4, 8), torch.randn(1, 8, 4, 8))), r"q \[B, n, H, D\].*got q \(8, 4, 8\)"),
    "v_shape_differs_from_k": (lambda: _attn(qkv=(torch.randn(1, 8, 4, 8), torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8))), r"v \(1, 8, 2, 8\)"),
    "k_batch_differs": (lambda: _attn(qkv=(torch.randn(1, 8, 4, 8), torch.randn(2, 8, 4, 8), torch.randn(2, 8, 4, 8))), r"k \(2, 8, 4, 8\) must match q"),
    "k_head_dim_differs": (lambda: _attn(qkv=(torch.randn(1, 8, 4, 8), torch.randn(1, 8, 4, 4), torch.randn(1, 8, 4, 4))), r"head dim"),
    "dtype_mismatch": (lambda: _attn(qkv=(torch.randn(1, 8, 4, 8), torch.randn(1, 8, 4, 8, dtype=torch.float64), torch.randn(1, 8, 4, 8, dtype=torch.float64))), r"torch.float32.*torch.float64"),
    "device_mismatch": (lambda: _attn(qkv=(torch.randn(1, 8, 4, 8), torch.randn(1, 8, 4, 8, device="meta"), torch.randn(1, 8, 4, 8, device="meta"))), r"cpu.*meta"),
    "integer_tensors": (lambda: _attn(qkv=tuple(torch.ones(1, 8, 4, 8, dtype=torch.int64) for _ in range(3))), r"torch.int64.*float"),
    "heads_not_multiple_of_kv_heads": (_bad_heads, r"H=4 must be a multiple of key/value heads H_kv=3"),
    "ulysses_above_heads": (_u_above_heads, r"ulysses_degree=2 exceeds the 1 query heads"),
    "length_not_divisible_by_layout": (lambda: _attn(mesh=_mesh(u=1), qkv=_qkv(n=3)), r"\b6\b.*(pad|multiple)"),
    "positions_not_global": (lambda: _attn(mesh=_mesh(u=1), positions=torch.arange(8)), r"position"),
    "doc_ids_wrong_length": (lambda: _attn(doc_ids=torch.zeros(5, dtype=torch.long)), r"doc_ids has 5 tokens.*S = "),
    "window_zero": (lambda: _attn(window=0), r"window=0 is invalid"),
    "kernel_flash_attn_on_cpu": (lambda: _attn(mesh=_mesh(kernel="flash_attn")), r"flash_attn"),
    "ulysses_attention_with_ring": (lambda: _mesh(u=1, attention="ulysses"), r"ulysses"),
    "ring_attention_with_ulysses": (lambda: _mesh(u=2, attention="ring"), r"ring"),
    "sparse_length_not_block_multiple": (lambda: _attn(mesh=_mesh(u=1, layout=None, attention="sparse_ring", sparse={"block_size": 64}), qkv=_qkv(n=16)), r"sequence length 32 cannot be split.*multiple of 128; pad it to 128"),
    "linear_decay_wrong_shape": (lambda: _linear(log_decay=torch.zeros(3)), r"log_decay"),
    "linear_unusable_layout": (lambda: _linear(layout="stripe"), r"stripe"),
    "config_unknown_key": (lambda: parse_section({"size": 2, "ulysess_degree": 2}), r"ulysess_degree"),
    "config_degree_not_divisor": (lambda: parse_section({"size": 8, "ulysses_degree": 3}), r"ulysses_degree=3 does not divide size=8; valid: 1, 2, 4, 8"),
    "config_size_not_int": (lambda: parse_section({"size": "8"}), r"size"),
    "config_layout_unknown": (lambda: parse_section({"size": 2, "ring": {"layout": "spiral"}}), r"spiral"),
    "config_attention_unknown": (lambda: parse_section({"size": 2, "attention": "flash"}), r"flash"),
    "config_fault_timeout_negative": (lambda: parse_section({"size": 2, "fault_timeout_s": -1}), r"fault_timeout_s"),
    "config_fault_timeout_zero": (lambda: parse_section({"size": 2, "fault_timeout_s": 0}), r"fault_timeout_s=0 must be > 0 seconds.*e\.g\. 1800"),
    "config_deepspeed_key_misspelt": (lambda: load_config({"zero_optimisation": {"stage": 3}, "sequence_parallel": {"size": 2}}), r"'zero_optimisation' is not a DeepSpeed .*did you mean 'zero_optimization'\?"),
    "config_zero_key_misspelt": (lambda: load_config({"zero_optimization": {"stgae": 3}, "sequence_parallel": {"size": 2}}), r"'zero_optimization\.stgae' .*did you mean 'stage'\?"),
    "config_section_not_a_dict": (lambda: parse_section([2]), r"must be an object"),
    "config_file_missing": (lambda: load_config("/nonexistent/ds.json"), r"/nonexistent/ds.json"),
    "world_not_multiple_of_size": (lambda: SeqParMesh.from_config(parse_section({"size": 4})), r"(world|size).*(4|2)"),
    "batch_without_input_ids": (lambda: _shard_batch({"labels": torch.zeros(1, 8, dtype=torch.long)}), r"needs 'input_ids'.*\['labels'\]"),
    "input_ids_1d": (lambda: _shard_batch({"input_ids": torch.zeros(8, dtype=torch.long)}), r"input_ids must be \[B, S\]; got shape \(8,\)"),
    "labels_shape_differs": (lambda: _shard_batch({"input_ids": torch.zeros(1, 8, dtype=torch.long), "labels": torch.zeros(1, 7, dtype=torch.long)}), r"labels has shape \(1, 7\)"),
    "cu_seqlens_not_from_zero": (lambda: doc_ids_from_cu_seqlens([2, 8], 8), r"cu_seqlens=\[2, 8\] must start at 0"),
    "cu_seqlens_not_increasing": (lambda: doc_ids_from_cu_seqlens([0, 4, 4, 8], 8), r"strictly increasing"),
    "cu_seqlens_past_the_end": (lambda: doc_ids_from_cu_seqlens([0, 9], 8), r"ends at 9, beyond the sequence length 8"),
}  # fmt: skip


def run_bad_case(name: str) -> tuple[str, str]:
    """On a rank: run the case under the tripwire; return (exception type, message)."""
    call, _ = CASES[name]
    with _tripwire():
        try:
            call()
        except CollectiveStarted as exc:
            return "CollectiveStarted", str(exc)
        except Exception as exc:
            return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_refused_before_any_collective(dist_pool, name: str) -> None:
    _, pattern = CASES[name]
    for rank, (kind, message) in enumerate(dist_pool(2).run(run_bad_case, name)):
        assert kind not in ("CollectiveStarted", "no error"), f"{name}, rank {rank}: {kind}: {message}"
        assert re.search(pattern, message, re.S), f"{name}, rank {rank}: {kind}: {message!r} !~ {pattern!r}"


# ------------------------------------------------------------------ ranks whose inputs disagree
# The one collective allowed: the SP group's all-gather of every rank's shapes (parallel/agree.py).


@contextmanager
def _counted_collectives():
    """Count the torch.distributed calls by name (they still run; isend / irecv stay unwrapped: P2POp
    checks their identity, and batch_isend_irecv counts the batched P2P)."""
    names = [n for n in COMM if n not in ("isend", "irecv")]
    saved, calls = {name: getattr(dist, name) for name in names}, []

    def counted(name: str) -> Callable:
        def call(*args, **kwargs):
            calls.append(name)
            return saved[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counted(name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _uneven_attention(rank: int):
    return ds_seqpar.attention(*_qkv(n=8 * (1 + rank)), mesh=_mesh())


def _uneven_kv_heads(rank: int):
    return ds_seqpar.attention(*_qkv(h_kv=2 * (1 + rank)), mesh=_mesh(u=1))


def _uneven_linear(rank: int):
    return _linear() if rank == 0 else linear_attention(*_qkv(n=16), mesh=_mesh(u=1, layout="contiguous"))


def _uneven_delta(rank: int):
    q, k, v = _qkv(n=8 + 8 * rank)
    beta = torch.rand(q.shape[:3])
    return ds_seqpar.delta_rule_attention(q, k, v, beta, mesh=_mesh(u=1, layout="contiguous"))


def _uneven_conv(rank: int):
    x = torch.randn(1, 8 + 4 * rank, 6)
    return ds_seqpar.sharded_causal_conv1d(x, (torch.randn(6, 4), None), mesh=_mesh(u=1, layout="contiguous"))


DISAGREEING = {
    "attention_local_length": (_uneven_attention, r"ds_seqpar.attention: .*rank 0: q \[1, 8, 4, 8\].*rank 1: q \[1, 16, 4, 8\]"),
    "attention_kv_heads": (_uneven_kv_heads, r"rank 0: .*k \[1, 8, 2, 8\].*rank 1: .*k \[1, 8, 4, 8\]"),
    "linear_local_length": (_uneven_linear, r"linear_attention: .*rank 1: q \[1, 16, 4, 8\]"),
    "delta_local_length": (_uneven_delta, r"delta_rule_attention: .*rank 1: q \[1, 16, 4, 8\]"),
    "conv_local_length": (_uneven_conv, r"sharded_causal_conv1d: .*rank 0: x \[1, 8, 6\].*rank 1: x \[1, 12, 6\]"),
}  # fmt: skip


def run_disagreeing_case(name: str) -> tuple[str, str, list[str]]:
    """On a rank: the case with this rank's inputs; (exception type, message, the collectives it called)."""
    call, _ = DISAGREEING[name]
    with _counted_collectives() as calls:
        try:
            call(dist.get_rank())
        except Exception as exc:
            return type(exc).__name__, str(exc), calls
    return "no error", "", calls


@pytest.mark.parametrize("name", sorted(DISAGREEING))
def test_ranks_with_different_shapes_are_named_on_every_rank(dist_pool, name: str) -> None:
    """Each rank's own input is valid, but they differ: every rank raises RankShapeError naming each rank's
    shapes after the one shape all-gather (no abort inside gloo, no hang)."""
    _, pattern = DISAGREEING[name]
    for rank, (kind, message, calls) in enumerate(dist_pool(2).run(run_disagreeing_case, name, timeout=60)):
        assert kind == "RankShapeError", f"{name}, rank {rank}: {kind}: {message}"
        assert re.search(pattern, message, re.S), f"{name}, rank {rank}: {message!r} !~ {pattern!r}"
        assert "every SP rank must pass the same" in message
        assert calls == ["all_gather"], calls


def run_twice_on_one_mesh() -> list[list[str]]:
    """Two calls with equal shapes on one mesh: the collectives of each."""
    mesh = _mesh(u=1)
    out = []
    for _ in range(2):
        with _counted_collectives() as calls:
            ds_seqpar.attention(*_qkv(), mesh=mesh)
        out.append(list(calls))
    return out


def test_the_shape_check_runs_once_per_shape(dist_pool) -> None:
    """The agreement is one all-gather on the first call with a shape; the next call runs none."""
    for first, second in dist_pool(2).run(run_twice_on_one_mesh, timeout=60):
        assert first.count("all_gather") == 1 and first[0] == "all_gather", first
        assert "all_gather" not in second and second, second
