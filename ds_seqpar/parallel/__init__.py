"""Algorithm layer: ops + comm composed into autograd Functions (no HuggingFace, no DeepSpeed)."""
