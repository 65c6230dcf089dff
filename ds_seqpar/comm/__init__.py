"""Communication layer: process-group primitives that count their bytes (no softmax, no models)."""
