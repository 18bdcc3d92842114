"""`/openapi.json` describes exactly the routes the app serves: compared with the app's own
`url_map`, so a route added without a description (or a description left behind by a removed
route) fails here."""

from __future__ import annotations

import re
from typing import Any

from tributary.app import create_app
from tributary.engine import GenerateRequest, SamplingParams
from tributary.testing import AppClient

#: Methods every route answers by itself (Quart adds them); the document leaves them out.
IMPLICIT = {"HEAD", "OPTIONS"}


def served_operations(app: Any) -> set[tuple[str, str]]:
    """(OpenAPI path, lower-case method) for every rule of the app's url_map."""
    operations = set()
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule.rule)
        for method in rule.methods - IMPLICIT:
            operations.add((path, method.lower()))
    return operations


def documented_operations(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(path, method) for path, item in doc["paths"].items() for method in item}


async def test_every_route_is_described_and_nothing_else(tributary_engine: Any) -> None:
    app = create_app(tributary_engine)
    reply = await AppClient(app).get("/openapi.json")
    assert reply.status == 200 and reply.headers["content-type"] == "application/json"
    doc = reply.json()
    served, documented = served_operations(app), documented_operations(doc)
    assert served - documented == set(), "routes missing from /openapi.json"
    assert documented - served == set(), "/openapi.json describes routes the app lacks"
    assert len(served) >= 20  # the comparison saw the real url_map


async def test_the_document_is_openapi_3_with_resolvable_references(
    tributary_client: AppClient,
) -> None:
    doc = (await tributary_client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.")
    schemas = doc["components"]["schemas"]
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', str(doc).replace("'", '"')))
    assert refs and refs <= set(schemas), refs - set(schemas)
    for item in doc["paths"].values():
        for operation in item.values():
            assert "200" in operation["responses"]


async def test_no_schema_says_an_empty_required_list(tributary_client: AppClient) -> None:
    """msgspec writes `"required": []` for a declaration whose fields all have defaults; the
    document leaves it out (it says nothing, and the hand-written schemas never had it)."""
    doc = (await tributary_client.get("/openapi.json")).json()
    empty: list[str] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            if node.get("required") == []:
                empty.append(where)
            for key, value in node.items():
                walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}/{i}")

    walk(doc, "")
    assert empty == []
    assert "SamplingParams" in doc["components"]["schemas"]  # the generated ones were walked


async def test_a_busy_flush_cache_answers_a_documented_status(
    tributary_client: AppClient, tributary_engine: Any
) -> None:
    """SGLang's `/flush_cache` says 400 while requests run; the document must list it
    (schemathesis never sees a busy engine, so only this catches it)."""
    sampling = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 1000})
    doc = (await tributary_client.get("/openapi.json")).json()
    async with tributary_engine.submit(GenerateRequest(text="busy", sampling=sampling)):
        for method in ("get", "post"):
            reply = await tributary_client.request(method.upper(), "/flush_cache")
            assert reply.status == 400
            assert "400" in doc["paths"]["/flush_cache"][method]["responses"]


async def test_the_worker_routes_document_their_refusals_and_fields(
    tributary_client: AppClient,
) -> None:
    """A front's worker routes answer 401 (no admin key sent) and 403 (worker management
    off: no --admin-api-key), and a worker's state has its number, `id`
    (tests/remote/test_hostile_workers.py sees them answered)."""
    import dataclasses

    from tributary.engine.remote.worker import RemoteWorkerStats

    doc = (await tributary_client.get("/openapi.json")).json()
    for path, method in (
        ("/list_workers", "get"),
        ("/add_worker", "post"),
        ("/remove_worker", "post"),
    ):
        responses = doc["paths"][path][method]["responses"]
        assert {"200", "401", "403"} <= set(responses), (path, sorted(responses))
    worker = doc["paths"]["/list_workers"]["get"]["responses"]["200"]["content"]
    items = worker["application/json"]["schema"]["properties"]["workers"]["items"]
    fields = {f.name for f in dataclasses.fields(RemoteWorkerStats)}
    assert fields == set(items["properties"]), fields ^ set(items["properties"])
