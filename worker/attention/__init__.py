"""Attention metadata and the attention backends."""
