"""Vision-language models under sequence parallelism (docs/multimodal.md): ``SeqParVisionLM``, the split vision
tower (``split_tower.py``, rules in ``towers.py``) and the language model on this rank's tokens (``language.py``)."""

from ds_seqpar.integrations.vision.wrapper import SeqParVisionLM

__all__ = ["SeqParVisionLM"]
