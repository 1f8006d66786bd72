"""Checkpoints: ``autoddp.save``/``load`` of whole files (``files``: collected on every rank,
written once by rank 0, never torn) and of distributed checkpoints (``distributed``: a folder of
shards through ``torch.distributed.checkpoint``). Import the module you need: this package
imports nothing.
"""
