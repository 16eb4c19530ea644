"""The request path as named stages, each a unit that can be read and tested alone:

1. admit (:mod:`.admit`): who is asking — request id, session, tenant from the API key — and the body, read within
   the server's limits (size, time, JSON items);
2. parse (:mod:`.parse`): the body decoded, its model known, its cache salt the tenant's;
3. tokenize and 4. route (:mod:`.route`, running :class:`kvgate.router.routing.router.Router`): the prompt's token ids
   as the engine will see them, then its block keys looked up in the prefix index and the policy's decision;
5. forward (:mod:`.forward`): a transfer's first leg, the request sent with retries and first-byte deadlines, the
   answer relayed;
6. account (:mod:`.account`): metrics, the request's log line, calibration samples.

:class:`kvgate.router.gateway.Gateway` composes them for each endpoint; explain runs the same stages up to route.
"""
