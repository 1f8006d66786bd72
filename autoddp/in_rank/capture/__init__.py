"""Capture: distribute the models, loaders and saves a plain single-GPU function or script makes.

A ``Session`` (``session``) installs the hooks of each family around the user's code only and
removes them after: ``optimizers`` (models found through their optimizers), ``loader_hooks``
(DataLoaders sharded when iterated), ``saves`` (``torch.save`` written once, by rank 0),
``steps`` (backward, optimizer steps, a user's own DDP), ``devices`` (cuda:0 habits: the own
GPU), ``trackers`` (wandb, TensorBoard, MLflow: one run, rank 0's) and ``shared_files`` (files
several ranks wrote). ``capturing`` runs a block under capture.
"""

from __future__ import annotations

from autoddp.in_rank.capture.session import Session, capturing

__all__ = ["Session", "capturing"]
