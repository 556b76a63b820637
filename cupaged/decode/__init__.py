"""Paged decode: the public ops and wrapper (``api``), their host checks (``checks``), the pure
host plan of the split-KV schedule (``plan``, NumPy only) and the launches (``launch``)."""
