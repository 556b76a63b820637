"""Prefill (ragged and paged): the public ops and wrapper (``api``), the pure host plan of the
tile work list (``plan``, NumPy only) and the launches (``launch``)."""
