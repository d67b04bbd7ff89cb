"""TLS and SASL settings: what each client is given, and the combinations refused at start."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from pydantic import ValidationError

from plumbing.clients import admin_options, consumer_options, producer_options, redis_security
from queue_schemas.settings import BusSettings
from tests.tls import make_certificates


def test_plaintext_is_the_default_and_adds_nothing() -> None:
    settings = BusSettings(kafka_bootstrap="k:9092")
    for options in (producer_options(settings), consumer_options(settings, "g"), admin_options(settings)):
        assert options["security_protocol"] == "PLAINTEXT"
        assert options["bootstrap_servers"] == "k:9092"
        assert "ssl_context" not in options
        assert "sasl_mechanism" not in options
    assert redis_security(settings) == {}


def test_sasl_over_tls_reaches_every_kafka_client(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path)
    settings = BusSettings(
        kafka_security_protocol="SASL_SSL", kafka_ssl_cafile=certs.ca, kafka_sasl_username="svc",
        kafka_sasl_password="s3cret",  # type: ignore[arg-type]
    )  # fmt: skip
    for options in (producer_options(settings), consumer_options(settings, "g"), admin_options(settings)):
        assert options["security_protocol"] == "SASL_SSL"
        assert isinstance(options["ssl_context"], ssl.SSLContext)
        assert options["ssl_context"].verify_mode == ssl.CERT_REQUIRED
        assert options["sasl_mechanism"] == "SCRAM-SHA-512"
        assert (options["sasl_plain_username"], options["sasl_plain_password"]) == ("svc", "s3cret")
    assert "s3cret" not in repr(settings), "the password is a secret in logs and reprs"


def test_redis_password_and_tls_files_go_to_the_connection_pool(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path)
    settings = BusSettings(
        redis_url="rediss://redis.internal:6380/0", redis_password="pw",  # type: ignore[arg-type]
        redis_ssl_ca_certs=certs.ca, redis_ssl_certfile=certs.cert, redis_ssl_keyfile=certs.key,
    )  # fmt: skip
    assert redis_security(settings) == {
        "password": "pw",
        "ssl_ca_certs": str(certs.ca),
        "ssl_certfile": str(certs.cert),
        "ssl_keyfile": str(certs.key),
    }


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kafka_security_protocol": "SASL_SSL"}, "needs a SASL username and password"),
        ({"kafka_ssl_cafile": Path("ca.pem")}, "SLUICE_KAFKA_SECURITY_PROTOCOL is PLAINTEXT"),
        ({"redis_ssl_ca_certs": Path("ca.pem")}, "not a rediss:// URL"),
        (
            {"kafka_security_protocol": "SSL", "kafka_ssl_certfile": Path("c.pem")},
            "both a certificate and a key",
        ),
    ],
)
def test_incomplete_security_settings_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        BusSettings(**fields)  # type: ignore[arg-type]
