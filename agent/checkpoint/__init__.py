"""Tiered checkpoint store: the shared file formats, the training-side library and the
agent-side tier store (docs/checkpointing.md has the design).

- :mod:`~tierwatch.agent.checkpoint.format`: what both sides read and write, torch-free:
  file layout, manifests and commit markers, restore requests and timelines, the pure
  completeness and agreement rules.
- :mod:`~tierwatch.agent.checkpoint.training`: the training process's library
  (:class:`~tierwatch.agent.checkpoint.training.checkpointer.TieredCheckpointer` and its
  collaborators: collectives, state adapter, snapshot staging, commit decision, restore,
  rollback serving, RNG and sampler state, the agent client). The modules that handle
  tensors import torch; only the training process imports them (``from tierwatch import
  TieredCheckpointer``).
- :mod:`~tierwatch.agent.checkpoint.tierstore`: the agent process's tier store (memory
  store, tier worker, replication, persistent tier, restore staging, restore requests, the
  ``/v1/ckpt`` and ``/v1/peer`` API, ``tierwatch-agent ckpt``), torch-free.

Importing this package (or any subpackage) imports neither torch nor the server.
"""
