"""Adapters that plug cupaged into other libraries.

Each submodule imports its library (and torch) only when it is itself imported, so
``import cupaged`` and ``import cupaged.integrations`` stay free of them.

- ``cupaged.integrations.transformers``: the ``"cupaged"`` and ``"paged|cupaged"``
  attention implementations of Hugging Face transformers.
"""
