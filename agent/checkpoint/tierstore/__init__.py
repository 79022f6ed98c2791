"""The agent process's side of the checkpoint store (no torch): the node's memory folder
(:mod:`.store`), replication to peers (:mod:`.replicator`) and uploads to the persistent tier
(:mod:`.persister`) by the tier worker (:mod:`.worker`), restore staging
(:mod:`.restore_staging`), restore requests (:mod:`.requests`), the HTTP API (:mod:`.api`) and
``tierwatch-agent ckpt`` (:mod:`.cli`)."""
