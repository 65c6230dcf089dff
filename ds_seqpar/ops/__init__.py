"""Math layer: single-device attention blocks, masks and merges (no process groups)."""
