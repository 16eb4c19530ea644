"""The APIs kvgate's front doors speak, one module each: what the gateway needs to know of an API's request and
response bodies (its prompt, its output budget, its streams' first token and end, its usage, its errors, and the
legs a transfer or a handoff sends). :class:`~kvgate.router.apis.base.Api` is the one interface; the rest of the
gateway knows no API's field names."""
