"""Data: the user's DataLoaders across ranks.

``samplers`` (the sharded, streamed sampler and the self-advancing epoch), ``draws`` (the user's
random streams around a sharded pass), ``loaders`` (which loaders are sharded and how) and
``gather`` (per-sample results back in the single process's order). Import the module you need:
this package imports nothing.
"""
