"""Prefill (ragged and paged): the public ops and wrapper (``api``) and the pure host plan of the
tile work list (``plan``, NumPy only)."""
