"""ds_seqpar: sequence parallelism for long-context training of HuggingFace models under DeepSpeed.

Public API (more arrives with the attention, data and engine modules):

* :func:`load_config` / :class:`SequenceParallelConfig`: the ``"sequence_parallel"`` section.
* :class:`SeqParMesh` / :func:`plan_mesh`: process groups and coordinates (world = dp x sp).
* :class:`CommStats`: bytes and messages per collective kind, per rank.
* :class:`StepWatch` / :class:`StepFailed`: a failed, dead or hung rank named with its step.
* :class:`UnsupportedModelError`: a model feature ds_seqpar cannot honour (named; see docs/models.md).
* :class:`LayoutError`: a sequence length or shard that the token layout cannot split (a ValueError).
* :func:`attention`: exact attention over the SP group (USP / Ulysses / ring, per the config);
  :func:`cross_attention`: exact cross-attention over the ring (rotate the queries or K/V, by size);
  :func:`input_layout`: the token layout the data side shards with; :func:`sparse_stats`: per-layer
  imbalance ratio and density of ``attention: "sparse_ring"``; :func:`block_sparse_attention`
  (:class:`DitSparseSettings`, :func:`dit_sparse_stats`): block-sparse non-causal DiT attention, db-SP
  balanced (docs/dit_sparse.md); :func:`linear_attention`: linear
  attention (All-Scan over the ring) for linear and hybrid models; :func:`delta_rule_attention`: the
  gated delta rule (GDN, KDA) with matrix transitions; :func:`sharded_causal_conv1d`: the short causal
  conv1d those layers run first, with its halo from the neighbouring ranks; :func:`register_recurrent_layer`:
  route a new recurrent layer family (class -> forward).
* :class:`RankShapeError`: the ranks of an SP group passed inputs of different shapes (each rank's named).
* :func:`register_dit_plan` / :func:`register_dit_attention`: where a diffusion transformer's token streams
  are split and how an attention processor computes attention (docs/dit.md).
* :func:`register_schedule` / :func:`register_layout` / :func:`register_kernel` /
  :func:`register_sparse_kernel`: plug a new ring schedule, token layout or block kernel into the
  registries the config, the engine and the byte model read (docs/architecture.md).
* :func:`initialize`: ``deepspeed.initialize`` with the section honoured (mesh, mpu, HF attention
  routing, SP loss, sharding DataLoader); :class:`SeqParCausalLM` (:class:`SeqParMaskedLM` for
  bidirectional encoders, :class:`SeqParSeq2SeqLM` with :func:`shard_encoder_states` for
  encoder-decoders), :func:`shard_batch`,
  :func:`seqpar_dataloader`, :func:`sp_causal_lm_loss` are its parts.
* :class:`SeqParTrainer` (HF Trainer), :func:`with_sequence_parallel` (any Trainer subclass, e.g.
  TRL's ``SFTTrainer``), :func:`accelerate_prepare` (a loop under ``accelerate launch``).
* :func:`token_logprobs` (:class:`TokenLogprobs`): per-token log-probs and entropies of a sharded batch, this
  rank's or the whole sequence's (post-training losses, docs/post_training.md).
* :func:`prefill` (:class:`Prefilled`, :class:`ShardedCache`): the prompt's forward over the SP group, leaving
  each rank the K/V of its tokens; :func:`generate` (:class:`GenerateOutput`): decoding from that sharded
  cache with HF's sampling arguments; :func:`register_prefill_mode` (:class:`PrefillMode`): another way to
  run the prefill (docs/inference.md); :func:`register_recurrent_decoder` (:class:`RecurrentDecoder`): a
  recurrent layer that decodes from the state the prefill keeps (docs/inference.md).
* :func:`memory_estimate` / :func:`largest_seq_len` / :func:`prefill_memory_estimate` /
  :func:`decode_cache_bytes`: the memory model (predicted peak bytes per rank by
  category, docs/memory.md).
"""

from ds_seqpar import plan as _plan  # noqa: F401 - registers the resolver of sequence_parallel.plan="auto"
from ds_seqpar.comm.schedules import register_schedule
from ds_seqpar.comm.stats import CommRegion, CommStats
from ds_seqpar.comm.step_watch import StepFailed, StepWatch
from ds_seqpar.config import SeqParConfigError, SequenceParallelConfig, load_config, parse_section
from ds_seqpar.data import SeqParCollator, seqpar_dataloader, shard_batch
from ds_seqpar.integrations import apb_prefill as _apb_prefill  # noqa: F401 - registers prefill "apb", "star"
from ds_seqpar.integrations.attention_layers import register_attention_layer
from ds_seqpar.integrations.causal_lm import SeqParCausalLM, SeqParMaskedLM
from ds_seqpar.integrations.deepspeed import initialize, install_deepspeed_guard, sequence_parallel_scope
from ds_seqpar.integrations.dit import (
    SeqParDiT,
    register_dit_attention,
    register_dit_plan,
)
from ds_seqpar.integrations.generation import GenerateOutput, generate
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.integrations.logprobs import TokenLogprobs, token_logprobs
from ds_seqpar.integrations.prefill import Prefilled, PrefillMode, prefill, register_prefill_mode
from ds_seqpar.integrations.recurrent_decoders import RecurrentDecoder, register_recurrent_decoder
from ds_seqpar.integrations.recurrent_layers import register_recurrent_layer
from ds_seqpar.integrations.routing import disable_sequence_parallel, enable_sequence_parallel
from ds_seqpar.integrations.seq2seq import SeqParSeq2SeqLM, shard_encoder_states
from ds_seqpar.integrations.sharded_cache import ShardedCache
from ds_seqpar.integrations.vision import SeqParVisionLM
from ds_seqpar.layout import LayoutError, register_layout
from ds_seqpar.loss import sp_causal_lm_loss
from ds_seqpar.memory import (
    MemoryEstimate,
    decode_cache_bytes,
    largest_seq_len,
    memory_estimate,
    prefill_memory_estimate,
)
from ds_seqpar.mesh import DeepSpeedMPU, MeshCoords, MeshPlan, SeqParMesh, plan_mesh
from ds_seqpar.ops.attention import register_kernel
from ds_seqpar.ops.sparse import register_sparse_kernel
from ds_seqpar.parallel.agree import RankShapeError
from ds_seqpar.parallel.cross import cross_attention
from ds_seqpar.parallel.delta_scan import delta_rule_attention, sharded_causal_conv1d
from ds_seqpar.parallel.dit_settings import DitSparseSettings
from ds_seqpar.parallel.dit_sparse import DitSparseStats, block_sparse_attention, dit_sparse_stats
from ds_seqpar.parallel.linear_scan import linear_attention
from ds_seqpar.parallel.sparse_ring import SparseLayerStats, sparse_stats
from ds_seqpar.parallel.usp import attention
from ds_seqpar.settings import SeqParSettings, input_layout

install_deepspeed_guard()  # plain deepspeed.initialize refuses configs with a sequence_parallel section

__version__ = "0.1.0"

__all__ = [
    "CommRegion",
    "CommStats",
    "DeepSpeedMPU",
    "DitSparseSettings",
    "DitSparseStats",
    "GenerateOutput",
    "LayoutError",
    "MemoryEstimate",
    "MeshCoords",
    "MeshPlan",
    "PrefillMode",
    "Prefilled",
    "RankShapeError",
    "RecurrentDecoder",
    "SeqParCausalLM",
    "SeqParCollator",
    "SeqParConfigError",
    "SeqParDiT",
    "SeqParMaskedLM",
    "SeqParMesh",
    "SeqParSeq2SeqLM",
    "SeqParSettings",
    "SeqParTrainer",
    "SeqParVisionLM",
    "SequenceParallelConfig",
    "ShardedCache",
    "SparseLayerStats",
    "StepFailed",
    "StepWatch",
    "TokenLogprobs",
    "UnsupportedModelError",
    "__version__",
    "accelerate_prepare",
    "attention",
    "block_sparse_attention",
    "cross_attention",
    "decode_cache_bytes",
    "delta_rule_attention",
    "disable_sequence_parallel",
    "dit_sparse_stats",
    "enable_sequence_parallel",
    "generate",
    "initialize",
    "input_layout",
    "largest_seq_len",
    "linear_attention",
    "load_config",
    "memory_estimate",
    "parse_section",
    "plan_mesh",
    "prefill",
    "prefill_memory_estimate",
    "register_attention_layer",
    "register_dit_attention",
    "register_dit_plan",
    "register_kernel",
    "register_layout",
    "register_prefill_mode",
    "register_recurrent_decoder",
    "register_recurrent_layer",
    "register_schedule",
    "register_sparse_kernel",
    "seqpar_dataloader",
    "sequence_parallel_scope",
    "shard_batch",
    "shard_encoder_states",
    "sharded_causal_conv1d",
    "sp_causal_lm_loss",
    "sparse_stats",
    "token_logprobs",
    "with_sequence_parallel",
]


def __getattr__(name: str):
    """``SeqParTrainer``, ``with_sequence_parallel`` and ``accelerate_prepare`` are imported on first use
    (transformers.Trainer and accelerate are heavy imports)."""
    if name in ("SeqParTrainer", "with_sequence_parallel"):
        from ds_seqpar.integrations import trainer

        return getattr(trainer, name)
    if name == "accelerate_prepare":
        from ds_seqpar.integrations.accelerate import accelerate_prepare

        return accelerate_prepare
    raise AttributeError(f"module 'ds_seqpar' has no attribute {name!r}")
