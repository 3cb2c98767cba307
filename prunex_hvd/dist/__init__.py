"""The distributed runtime: who is where (:mod:`.topology`), launcher detection and the control plane
(:mod:`.launch`), ``init`` (:mod:`.runtime`), collectives over the node, leader and world groups with their byte
accounting (:mod:`.comm`), checks every rank passes together (:mod:`.agreement`) and the watchdog that stops a
job with a dead or stalled rank, naming it (:mod:`.watchdog`). Knows nothing of models or the algorithm.
"""
