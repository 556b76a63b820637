"""The core every op family builds on: array modules and foreign arrays (``arrays``), argument
checks (``checks``), cache layouts and their strides (``layouts``), fp8 cache formats and scale
checks (``fp8``), device facts and uploads (``device``), the kernel loader (``compile``),
argument records and launches (``launch``), the kernels' ABI (``abi``), device errors
(``errors``) and the per-step object (``step``)."""
