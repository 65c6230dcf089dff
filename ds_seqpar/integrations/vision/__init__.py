"""Vision-language models under sequence parallelism (docs/multimodal.md): ``SeqParVisionLM``, the split vision
tower (``split_tower.py``, rules in ``towers.py``) and the language model on this rank's tokens (``language.py``)."""

from ds_seqpar.integrations.vision.wrapper import SeqParVisionLM, is_vision_lm, whole_inputs_of

__all__ = ["SeqParVisionLM", "is_vision_lm", "whole_inputs_of"]
