"""ds_seqpar: sequence parallelism for long-context training of HuggingFace models under DeepSpeed.

Public API (more arrives with the attention, data and engine modules):

* :func:`load_config` / :class:`SequenceParallelConfig`: the ``"sequence_parallel"`` section.
* :class:`SeqParMesh` / :func:`plan_mesh`: process groups and coordinates (world = dp x sp).
* :class:`CommStats`: bytes and messages per collective kind, per rank.
* :func:`attention`: exact attention over the SP group (USP / Ulysses / ring, per the config);
  :func:`input_layout`: the token layout the data side shards with.
"""

from ds_seqpar.comm.stats import CommRegion, CommStats
from ds_seqpar.config import SeqParConfigError, SequenceParallelConfig, load_config, parse_section
from ds_seqpar.mesh import DeepSpeedMPU, MeshCoords, MeshPlan, SeqParMesh, plan_mesh
from ds_seqpar.parallel.usp import attention, input_layout

__version__ = "0.1.0"

__all__ = [
    "CommRegion",
    "CommStats",
    "DeepSpeedMPU",
    "MeshCoords",
    "MeshPlan",
    "SeqParConfigError",
    "SeqParMesh",
    "SequenceParallelConfig",
    "__version__",
    "attention",
    "input_layout",
    "load_config",
    "parse_section",
    "plan_mesh",
]
