"""Rotary position embedding (``api``)."""
