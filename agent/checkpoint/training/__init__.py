"""The training process's side of the checkpoint store.

:mod:`.checkpointer` (:class:`TieredCheckpointer`) composes small collaborators: its
collectives (:mod:`.collectives`), the state dict adapter (:mod:`.state_adapter`), snapshot
staging (:mod:`.snapshot`), rank 0's commit decision (:mod:`.commit_decision`, pure), the
rank's memory-tier files (:mod:`.rank_files`), restore (:mod:`.restore`) and rollback serving
(:mod:`.rollback`). The modules that touch tensors import torch; :mod:`.client`,
:mod:`.errors`, :mod:`.commit_decision`, :mod:`.rank_files` and :mod:`.rollback` do not, and
this package imports nothing itself.
"""
