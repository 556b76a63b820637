"""The serving-engine parts built on the ops: block pools and tables (``blocks``), the paged KV
cache (``kv_cache``), attention layers (``layers``), the tiny reference model (``model``) and the
demo scheduler and engine (``demo``)."""
