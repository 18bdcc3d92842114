"""The HTTP plumbing both APIs share: ASGI middleware (`asgi`), the fast write path and
everything that touches Hypercorn's or h11's internals (`direct_send`), request limits and
deadlines (`limits`), reading a body (`body`) and all a generating view reads (`view`), the
API-key check (`auth`), the errors both raise and the one way their handlers are installed
(`errors`), JSON (`responses`) and SSE (`sse`) on the wire, streamed bodies and the delivery
contract (`streamed`), and bodies over several engine streams (`multiplex`).

Nothing here knows either API: `app/sglang` and `app/openai` import from here, never the
other way round.
"""
