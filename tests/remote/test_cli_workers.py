"""`tributary serve --worker-url/--workers-file`: which workers, of which kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tributary.app.cli import build_parser, configs, main, remote_config


def fleet_of(*argv: str):  # type: ignore[no-untyped-def]
    return remote_config(build_parser().parse_args(["serve", *argv]))


def test_no_worker_flag_serves_a_model() -> None:
    assert fleet_of() is None


def test_workers_from_flags_and_a_file(tmp_path: Path) -> None:
    listing = tmp_path / "workers"
    listing.write_text("# the fleet\nhttp://c:3 #third\nopenai http://d:4/\n\nhttp://e:5#openai\n")
    config = fleet_of(
        "--worker-url", "http://a:1", "--worker-url", "http://b:2#openai",
        "--workers-file", str(listing), "--policy", "round_robin", "--max-retries", "1",
    )  # fmt: skip
    assert config is not None
    assert config.workers == (
        ("http://a:1", "sglang"),
        ("http://b:2", "openai"),
        ("http://c:3", "sglang"),
        ("http://d:4", "openai"),
        ("http://e:5", "openai"),
    )
    assert (config.policy, config.max_retries) == ("round_robin", 1)
    default_kind = fleet_of("--worker-kind", "openai", "--worker-url", "http://a:1")
    assert default_kind is not None and default_kind.workers == (("http://a:1", "openai"),)


@pytest.mark.parametrize("url", ["a:1", "http://a:1#grpc", "sglang http://a:1 extra"])
def test_a_worker_that_makes_no_sense_is_refused(url: str) -> None:
    with pytest.raises(ValueError):
        fleet_of("--worker-url", url)


def test_a_workers_file_without_a_worker_is_refused(tmp_path: Path) -> None:
    """Not a front that quietly loads a model of its own instead."""
    listing = tmp_path / "workers"
    listing.write_text("# every worker is commented out\n# http://a:1\n\n")
    with pytest.raises(ValueError, match="names no worker"):
        fleet_of("--workers-file", str(listing))


def test_front_flags_for_silence_answer_size_and_client_code() -> None:
    """`--worker-timeout`, `--max-worker-answer-bytes`, and `--enable-custom-logit-processor`
    meaning, at a front, that it forwards custom logit processors (refused by default)."""
    default = fleet_of("--worker-url", "http://a:1")
    assert default is not None
    assert (default.worker_timeout, default.max_answer_bytes) == (600.0, 64 << 20)
    assert not default.enable_custom_logit_processor
    config = fleet_of(
        "--worker-url", "http://a:1", "--worker-timeout", "30",
        "--max-worker-answer-bytes", "1024", "--enable-custom-logit-processor",
    )  # fmt: skip
    assert config is not None
    assert (config.worker_timeout, config.max_answer_bytes) == (30.0, 1024)
    assert config.enable_custom_logit_processor
    for bad in (["--worker-timeout", "0"], ["--max-worker-answer-bytes", "0"]):
        with pytest.raises(ValueError):
            fleet_of("--worker-url", "http://a:1", *bad)


def test_an_admin_key_equal_to_the_api_key_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Else every holder of the API key is an admin: at a front, one who adds workers that
    then receive other users' prompts."""
    same = ["serve", "--api-key", "k", "--admin-api-key", "k", "--worker-url", "http://a:1"]
    with pytest.raises(ValueError, match="must differ from --api-key"):
        configs(build_parser().parse_args(same))
    assert main(same) == 2
    assert "--admin-api-key must differ from --api-key" in capsys.readouterr().err
    _, settings = configs(
        build_parser().parse_args(["serve", "--api-key", "k", "--admin-api-key", "boss"])
    )
    assert (settings.api_key, settings.admin_api_key) == ("k", "boss")
