"""Tiered checkpoint store: file layout, manifests, the agent-side tier host and the
training-side :class:`TieredCheckpointer`.

Importing this package imports neither torch nor the server: the agent uses the torch-free
modules (``layout``, ``manifest``, ``store``, ``replicator``, ``persister``, ``api``); only
``trainer``, ``staging``, ``state`` and ``restore`` import torch, and only the training
process imports them (``from tierwatch import TieredCheckpointer``). See
``docs/checkpointing.md`` for the design.
"""
