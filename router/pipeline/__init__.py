"""The request path as named stages, one module each, in the order a request meets them:

1. admit (:mod:`.admit`): who is asking (request id, session, tenant from the API key) and the body, read within the
   server's limits (size, time, JSON values and objects);
2. parse (:mod:`.parse`): the body decoded once, by its API; its model one the caller may use; its cache salt the
   tenant's; no field that steers the engine;
3. tokenize (:mod:`.tokenize`): the replicas that may serve the model, and the prompt's token ids as the engine will
   see them;
4. route (:mod:`.route`): the prompt's block keys looked up in the prefix index, the policy's decision, and the
   attempts' plan (which replicas, each attempt's first-byte deadline);
5. forward (:mod:`.forward`): a handoff's legs or the request itself, sent with retries, cancelled if the client
   leaves;
6. relay (:mod:`.relay`): the answer sent on with kvgate's headers, streamed as it comes;
7. account (:mod:`.account`): metrics, the request's one log line, calibration samples.

Below them: reading bodies (:mod:`.bodies`), watching for a client that leaves (:mod:`.disconnect`) and how the
stages' errors are answered (:mod:`.errors`). Each endpoint flow (:mod:`kvgate.router.endpoints`) composes the
stages it needs; explain runs them up to route.
"""
