"""The policy file: its root schema (:mod:`.schema`), what it must mean to be put in force (:mod:`.validate`), and the
holder of the one in force, with hot reload (:mod:`.holder`)."""
