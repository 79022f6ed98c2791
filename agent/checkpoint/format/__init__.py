"""What the trainer and the agent share, torch-free: where checkpoint files live
(:mod:`.layout`), what they say (:mod:`.manifest`, :mod:`.rollback`), which step a restore
loads (:mod:`.agreement`, pure), and the background threads' CPU priority
(:mod:`.priority`)."""
