"""Paged-cache writes, block copies and swaps (``api``)."""
