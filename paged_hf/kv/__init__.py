"""The KV allocator, one job a file (see docs/kv.md): ``manager`` (``KVManager``: sequences, growth, audit, stats)
and ``sizing`` (what its pools cost, their allocation), over ``layer_groups`` (window rules), ``rows`` (block-table
and tail rows), ``copies`` (kinds, log, apply), ``prefix_cache``, ``swap``, ``growth``, ``audit``, ``sequence`` and
``model_config``. Import from the module that defines a name; this package exports nothing itself.
"""
