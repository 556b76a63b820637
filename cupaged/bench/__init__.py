"""Benchmarks: each module's ``run(quick=False)`` returns rows (dicts) for one op family.

``cupaged bench NAME`` and ``scripts/bench.py`` print them; they need a CUDA device.
"""
