"""One module per endpoint flow, each composed from the request path's stages (:mod:`kvgate.router.pipeline`):
generation (chat completions, completions), passthrough (embeddings), explain, the HTTP KV-event ingest, the peer
snapshot, and the informational endpoints (models, health, readiness, metrics). Who may call what is
:mod:`.callers`. Each flow is handed the components it uses; the app (:mod:`kvgate.router.app.gateway_app`) routes
requests to them."""
