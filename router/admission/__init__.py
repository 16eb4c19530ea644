"""Admission at the gateway: when no replica can start a request soon, it waits here instead of in an engine's
queue, and is released by priority band, then by weighted fairness between tenants (in prefill tokens), then in
arrival order, to be routed on the state at its release; tenants' rate and concurrency limits come first."""
