"""``sequence_parallel.inference``: how a long prompt is prefilled under SP (docs/inference.md "APB and Star
Attention"): ``exact`` (the plain SP forward), ``apb`` (anchor block + passing blocks) or ``star`` (Star
Attention: anchor block only). Only the section's own checks live here; the model-dependent ones run in
``prefill()``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

__all__ = ["APB_KEYS", "InferenceConfig"]

PrefillName = Literal["exact", "apb", "star"]
CompressionName = Literal["query_attention"]
APB_KEYS = ("anchor_len", "query_len", "passing_len", "compression")  # read by "apb" / "star" only


class InferenceConfig(BaseModel):
    """``sequence_parallel.inference``: the prefill mode and the APB / Star Attention parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill: PrefillName = Field(
        "exact",
        description="Prefill of ds_seqpar.prefill / generate: exact (the SP forward) | apb (every rank: anchor "
        "block + the compressed blocks passed by the earlier ranks + its own block; approximate) | star (Star "
        "Attention: anchor block + own block; approximate, no communication in attention).",
    )
    anchor_len: StrictInt = Field(
        1024,
        ge=0,
        description="apb / star: l_a, the first l_a prompt tokens prepended to every rank's block.",
    )
    query_len: StrictInt = Field(
        64,
        ge=0,
        description="apb / star: l_q, the last l_q prompt tokens (the question) embedded at the end of the anchor "
        "block; apb scores the keys to pass with them.",
    )
    passing_len: StrictInt = Field(
        1024,
        ge=0,
        description="apb: l_p, the keys per KV head and layer each rank passes to the later ranks (star: 0).",
    )
    compression: CompressionName = Field(
        "query_attention",
        description="apb: how the passed keys are chosen: query_attention (softmax attention of the l_q query "
        "rows over the rank's keys, summed per KV head; training-free stand-in for APB's retaining heads).",
    )

    @model_validator(mode="after")
    def _check(self) -> InferenceConfig:
        key = "sequence_parallel.inference"
        given = [k for k in APB_KEYS if k in self.model_fields_set]
        if self.prefill == "exact" and given:
            raise ValueError(
                f"{key}.{given[0]}={getattr(self, given[0])!r} is set but {key}.prefill='exact' ignores it; "
                "valid: prefill='apb' or 'star', or remove it"
            )
        if self.prefill == "star" and "passing_len" in self.model_fields_set and self.passing_len != 0:
            raise ValueError(
                f"{key}.passing_len={self.passing_len} with prefill='star': Star Attention passes no blocks; "
                "valid: prefill='apb', or remove passing_len"
            )
        if self.prefill == "apb" and (self.passing_len == 0 or self.query_len == 0):
            bad = "passing_len" if self.passing_len == 0 else "query_len"
            raise ValueError(
                f"{key}.{bad}=0 with prefill='apb': APB passes passing_len keys chosen by the query_len query "
                "rows; valid: both >= 1, or prefill='star'"
            )
        return self

    @property
    def passing(self) -> int:
        """The passing length the mode runs with (0 for star and exact)."""
        return self.passing_len if self.prefill == "apb" else 0
