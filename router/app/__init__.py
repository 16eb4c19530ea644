"""The process: ``kvgate serve`` (:mod:`.server`) running the ASGI app (:mod:`.asgi`) under uvicorn with kvgate's
bounded HTTP protocol (:mod:`.protocol`), the admin endpoints (:mod:`.admin`) and ``kvgate demo`` (:mod:`.demo`)."""
