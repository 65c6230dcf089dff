"""Diffusion transformers under ds_seqpar (docs/dit.md): ``parallelize`` a diffusers pipeline over the world
(exact SP, CFG parallel, PipeFusion), ``load_pipeline`` a pipeline folder, the training targets (``losses``)."""

from ds_seqpar.dit import losses
from ds_seqpar.dit.pipeline import load_pipeline
from ds_seqpar.dit.run import DitRun, parallelize

__all__ = ["DitRun", "load_pipeline", "losses", "parallelize"]
