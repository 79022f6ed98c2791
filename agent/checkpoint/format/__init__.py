"""What the trainer and the agent share, torch-free: where checkpoint files live
(:mod:`.layout`), what they say (:mod:`.manifest`, :mod:`.rollback`), when a step is complete
(:mod:`.completeness`) and which step a restore loads (:mod:`.agreement`), both pure, and the
background threads' CPU priority (:mod:`.priority`)."""
