"""The multimodal model sweep (benchmarks/vlm_sweep.py) on a few types, and the language-model input rules it
led to (ds_seqpar/integrations/vision/language.py): positions for a language model called without them, the
router-logits keyword, keywords without a rule."""

from __future__ import annotations

import pytest
import torch
import transformers

from benchmarks import model_sweep
from benchmarks.vlm_sweep import SECTION, section_markdown, sweep_vlms, write_section
from ds_seqpar import UnsupportedModelError
from ds_seqpar.integrations.vision.language import TokenShard, _local_inputs
from ds_seqpar.integrations.vision.refusals import refuse_unsupported_vlm
from ds_seqpar.layout import UspLayout
from ds_seqpar.layout.ring import ZigzagLayout

# (type, expected status, a phrase of the detail): LLaVA (a CLIP tower split by images), Qwen2.5-Omni's
# thinker (a language model called without position ids: numbered each shard from 0 before the fix, a mismatch),
# Idefics2 (its perceiver connector builds a bidirectional mask: refused by the mask probe), Gemma 4 with
# bidirectional image blocks (the sweep's config; silently causal before the refusal)
CASES = [
    ("llava", "exact", "images"),
    ("qwen2_5_omni_thinker", "exact", "images"),
    ("idefics2", "refused", "sees later tokens"),
]
SLOW_CASES = [("gemma4", "refused", "use_bidirectional_attention='vision'")]  # a mismatch before the refusal


def _check_sweep(pool, cases):
    rows = pool.run(sweep_vlms, [t for t, _, _ in cases])[0]
    for (model_type, status, phrase), row in zip(cases, rows, strict=True):
        assert row["type"] == model_type
        assert row["status"] == status, row
        assert phrase in row["detail"], row


def test_sweep_classifies_each_type(dist_pool):
    _check_sweep(dist_pool(4), CASES)


@pytest.mark.slow
def test_sweep_refuses_gemma4_bidirectional_image_blocks(dist_pool):
    _check_sweep(dist_pool(4), SLOW_CASES)


class _Vlm(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.config = transformers.Gemma4Config(text_config={"use_bidirectional_attention": mode})


def test_bidirectional_image_blocks_refused_by_name():
    refuse_unsupported_vlm(_Vlm(None))  # the small models: causal, runs
    with pytest.raises(
        UnsupportedModelError, match=r"_Vlm: text_config.use_bidirectional_attention='vision'"
    ):
        refuse_unsupported_vlm(_Vlm("vision"))


def test_markdown_section_keeps_the_text_part(tmp_path):
    rows = [
        {"type": "llava", "status": "exact", "detail": "51 tokens; loss 0.0e+00, gradients 4.1e-07"},
        {"type": "smolvlm", "status": "refused", "detail": "X ... VLMs built as model.language_model + ..."},
    ]
    path = tmp_path / "models.md"
    path.write_text("# Model families under ds_seqpar\n\ntext table\n")
    for _ in range(2):  # writing twice replaces the section
        write_section(path, section_markdown(rows, 1.0, "python -m benchmarks.model_sweep --multimodal"))
    text = path.read_text()
    assert text.startswith("# Model families under ds_seqpar\n\ntext table\n\n" + SECTION)
    assert text.count(SECTION) == 1
    assert "| exact | 1 |" in text and "| refused | 1 |" in text
    assert "not built as model.language_model + model.<vision tower> | 1: `smolvlm`" in text
    model_sweep.write_markdown([{"type": "llama", "status": "exact", "detail": "ok"}], path, 1.0)
    again = path.read_text()  # the text sweep rewrites its part and keeps this section
    assert again.startswith("# Model families under ds_seqpar") and "| `llama` |" in again
    assert again.endswith(text[text.index(SECTION) :])


def _shard(rank: int = 1) -> TokenShard:
    """Rank ``rank`` of U2 x R2 zigzag over rows of 16 tokens whose text positions are 100..115."""
    layout = UspLayout(ZigzagLayout(2), 2)
    return TokenShard(layout, rank, 16, masks_handled=True, positions=torch.arange(100, 116)[None])


def test_language_model_without_position_ids_gets_this_ranks_row_positions():
    embeds = torch.randn(1, 16, 4)
    local = _local_inputs({"inputs_embeds": embeds, "position_ids": None}, _shard(1))
    assert local["position_ids"].tolist() == [[112, 113, 114, 115]]  # not 0..3: rank 1 holds tokens 12..15
    assert torch.equal(local["inputs_embeds"], embeds[:, 12:16])
    given = _local_inputs({"inputs_embeds": embeds, "position_ids": torch.arange(16)[None]}, _shard(1))
    assert given["position_ids"].tolist() == [[12, 13, 14, 15]]  # the VLM's own positions win


def test_router_logits_and_keywords_without_a_rule():
    embeds = torch.randn(1, 16, 4)
    assert "output_router_logits" not in _local_inputs(
        {"inputs_embeds": embeds, "output_router_logits": False}, _shard()
    )
    with pytest.raises(UnsupportedModelError, match="output_router_logits=True"):
        _local_inputs({"inputs_embeds": embeds, "output_router_logits": True}, _shard())
    assert "ple_input_ids" not in _local_inputs({"inputs_embeds": embeds, "ple_input_ids": None}, _shard())
    with pytest.raises(UnsupportedModelError, match=r"\['ple_input_ids'\]"):
        _local_inputs({"inputs_embeds": embeds, "ple_input_ids": torch.zeros(1, 16)}, _shard())
