"""The training process's side of the checkpoint store.

:mod:`.checkpointer` (:class:`TieredCheckpointer`), :mod:`.snapshot`, :mod:`.restore` and
:mod:`.state` import torch; :mod:`.client` and :mod:`.rollback`'s poller do not. This package
imports nothing itself, so ``import tierwatch.agent.checkpoint.training.client`` stays
torch-free.
"""
