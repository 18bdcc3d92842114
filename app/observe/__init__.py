"""Observing requests: each engine request's phases (`timing`), which it hands over as a frozen
`RequestRecord` (`record`); each HTTP exchange, which takes its requests' records as it ends,
decides which count as answers, and writes the access log (`exchange`); and `/metrics`
(`metrics`), which reads records. The imports run one way: exchange -> timing -> record,
exchange -> metrics -> record.

Nothing here knows either API: `app/sglang` and `app/openai` import from here, never the
other way round.
"""
