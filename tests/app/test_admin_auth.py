"""`--admin-api-key`: the routes that change server state (`ADMIN_PATHS`) need the admin key,
and the plain API key no longer opens them; every other route keeps the plain key (or the
admin key); health probes stay open. In-memory client on the sim runner."""

from __future__ import annotations

import pytest

from tributary import app, engine, testing
from tributary.app.sglang.admin import ADMIN_PATHS

USER = {"Authorization": "Bearer user-key"}
ADMIN = {"Authorization": "Bearer admin-key"}
ADMIN_DENIED = {
    "error": {
        "message": "This endpoint changes server state and needs the admin API key.",
        "code": 401,
    }
}


@pytest.fixture
def tributary_server_settings() -> app.ServerSettings:
    return testing.server_settings(api_key="user-key", admin_api_key="admin-key")


async def test_state_changing_routes_need_the_admin_key(
    tributary_client: testing.AppClient,
) -> None:
    client = tributary_client
    abort = {"abort_all": True}
    for headers in ({}, USER, {"Authorization": "Bearer wrong"}):
        denied = await client.post("/abort_request", json=abort, headers=headers)
        assert (denied.status, denied.json()) == (401, ADMIN_DENIED)
        assert (await client.post("/flush_cache", headers=headers)).status == 401
        assert (await client.get("/flush_cache", headers=headers)).status == 401
    assert (await client.post("/abort_request", json=abort, headers=ADMIN)).status == 200
    assert (await client.post("/flush_cache", headers=ADMIN)).status == 200
    # Anthropic's clients send a key as `x-api-key`: the admin key opens them that way too.
    assert (await client.post("/flush_cache", headers={"x-api-key": "user-key"})).status == 401
    assert (await client.post("/flush_cache", headers={"x-api-key": "admin-key"})).status == 200


async def test_other_routes_keep_the_plain_key_and_take_the_admin_key(
    tributary_client: testing.AppClient,
) -> None:
    client = tributary_client
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    assert (await client.post("/generate", json=body)).status == 401
    assert (await client.post("/generate", json=body, headers=USER)).status == 200
    assert (await client.post("/generate", json=body, headers=ADMIN)).status == 200
    for key in ("user-key", "admin-key"):
        response = await client.post("/generate", json=body, headers={"x-api-key": key})
        assert response.status == 200, key
    assert (await client.post("/generate", json=body, headers={"x-api-key": "wrong"})).status == 401
    assert (await client.get("/v1/models", headers=USER)).status == 200
    assert (await client.get("/health")).status == 200
    info = (await client.get("/get_server_info", headers=USER)).json()
    assert info["api_key"] == info["admin_api_key"] == "***"  # secrets never echoed


async def test_an_admin_key_alone_leaves_other_routes_open(
    tributary_engine: engine.Engine,
) -> None:
    quart_app = app.create_app(tributary_engine, testing.server_settings(admin_api_key="k"))
    client = testing.AppClient(quart_app)
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    assert (await client.post("/generate", json=body)).status == 200
    assert (await client.post("/abort_request", json={"abort_all": True})).status == 401
    ok = await client.post(
        "/abort_request", json={"abort_all": True}, headers={"Authorization": "Bearer k"}
    )
    assert ok.status == 200


#: Routes that only read or generate: anyone with the plain API key may call them.
ORDINARY_PATHS = {
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/v1/tokenize",
    "/detokenize",
    "/v1/detokenize",
    "/v1/embeddings",
    "/encode",
    "/v1/messages",
    "/v1/messages/count_tokens",
}


async def test_every_route_that_takes_a_body_is_classified(tributary_engine: engine.Engine) -> None:
    """A new POST/PUT/DELETE route must be put in ADMIN_PATHS or declared ordinary here, so a
    state-changing route never slips past the admin key."""
    quart_app = app.create_app(tributary_engine, testing.server_settings())
    writes = {
        rule.rule
        for rule in quart_app.url_map.iter_rules()
        if rule.methods and rule.methods & {"POST", "PUT", "PATCH", "DELETE"}
    }
    assert writes - ADMIN_PATHS - ORDINARY_PATHS == set()
    assert ADMIN_PATHS <= writes
