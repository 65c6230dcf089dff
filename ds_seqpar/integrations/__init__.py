"""Glue layer: HuggingFace attention registry, DeepSpeed engine and mpu."""
