"""Gateway replicas helping each other: a starting gateway takes its prefix index from a running peer (warm start,
over the snapshot format of :mod:`.snapshot`), and running ones exchange routing hints, work reports and warm-ups
over ZMQ (:mod:`.hints`, wired into this gateway by :mod:`.wiring`; the work reports land in
:mod:`kvgate.router.fleet.peer_work`)."""
