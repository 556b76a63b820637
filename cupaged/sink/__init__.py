"""Attention with sink logits and the sink softmax (``api``)."""
