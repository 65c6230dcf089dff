"""Shipped training tasks and data readers for ``train.py`` (nothing is downloaded)."""
