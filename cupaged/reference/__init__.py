"""NumPy reference backend: the specification every kernel is tested against.

Written from the math of docs/design.md, computing in float64; independent of the kernels.
Submodules: ``attention`` (masked softmax attention, varlen, paged, decode, mixed, merge),
``cache`` (cache write, copy, swap in every layout, quantising into fp8 caches), ``fp8`` (the
fp8 quantisation rule: quantise, dequantise, half-ulp bound), ``sink`` (sink softmax and the
sink-attention contract's unified sink attention), ``rope``, ``sparse`` (vertical+slash
estimate, index, BSR of one sequence), ``bsr`` (batched BSR attention: ragged and paged,
per-head patterns).
"""
