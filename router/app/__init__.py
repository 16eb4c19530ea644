"""The process: ``kvgate serve`` (:mod:`.server`) serving the gateway's routes (:mod:`.gateway_app`,
:mod:`.routes`) with kvgate's own HTTP protocol (:mod:`.protocol`) under uvicorn's server, the admin endpoints
(:mod:`.admin`) and ``kvgate demo`` (:mod:`.demo`)."""
