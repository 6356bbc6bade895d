"""An upstream's ``ca_file``: read at load into the context its calls are verified with, which
trusts its certificates alone (as curl's --cacert); a file that cannot serve refused at load,
naming the upstream and the path."""

from __future__ import annotations

import pickle
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main
from proxy.config import UpstreamConfig
from proxy.config_load import parse_config
from proxy.errors import ConfigError
from tests.conftest import PrivateCA, base_config


def loaded(upstream: dict[str, Any], *, key_secrets: bool = True) -> UpstreamConfig:
    raw = base_config("https://vllm.internal:8443/v1", "redis://127.0.0.1:1/0")
    raw["upstreams"]["openai"] |= upstream
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": "sk-k"}, key_secrets=key_secrets)
    return config.upstreams["openai"]


def refusal(upstream: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        loaded(upstream)
    return str(caught.value)


def test_the_ca_file_is_read_at_load_into_the_context_the_calls_are_sent_with(private_ca: PrivateCA) -> None:
    upstream = loaded({"ca_file": str(private_ca.ca)})
    context = upstream.ca_context
    assert isinstance(context, ssl.SSLContext)
    assert upstream.sending.tls is context  # built once, at load: not per call
    assert (context.verify_mode, context.check_hostname) == (ssl.CERT_REQUIRED, True)
    # Its CAs instead of the system's, as curl's --cacert and requests' verify=PATH.
    assert [ca["subject"] for ca in context.get_ca_certs()] == [((("commonName", "Test private-ca"),),)]
    assert loaded({}).sending.tls is True  # none: the connector's, the system's CAs


def test_a_config_with_a_ca_file_is_sent_to_a_worker_and_builds_its_own_context(
    private_ca: PrivateCA, tmp_path: Path
) -> None:
    """``serve --workers N`` sends each worker its config pickled (a spawned process): a config
    holding its ca_file's SSLContext could not be (``cannot pickle 'SSLContext' object``), and no
    worker started. The certificates travel as PEM text; each process builds its own context."""
    raw = base_config("https://vllm.internal:8443/v1", "redis://127.0.0.1:1/0")
    raw["upstreams"]["openai"]["ca_file"] = str(private_ca.ca)
    config = parse_config(raw, {"TEST_UPSTREAM_KEY": "sk-k"})
    assert config.upstreams["openai"].sending.tls is config.upstreams["openai"].ca_context  # built here
    received = pickle.loads(pickle.dumps(config))
    context = received.upstreams["openai"].ca_context
    assert isinstance(context, ssl.SSLContext) and context is not config.upstreams["openai"].ca_context
    assert [ca["subject"] for ca in context.get_ca_certs()] == [((("commonName", "Test private-ca"),),)]
    assert received == config


def test_a_bundle_with_comments_in_utf8_is_read_whole(private_ca: PrivateCA, tmp_path: Path) -> None:
    # As certifi's cacert.pem, which names each issuer in a comment.
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(
        "# Issuer: CN=Főtanúsítvány\n".encode()
        + private_ca.ca.read_bytes()
        + b"\n# another\n"
        + private_ca.other_ca.read_bytes()
    )
    context = loaded({"ca_file": str(bundle)}).ca_context
    assert context is not None and context.cert_store_stats()["x509_ca"] == 2


@pytest.mark.parametrize("beside", [False, True])
def test_a_certificate_under_the_older_x509_certificate_label_is_read(
    private_ca: PrivateCA, tmp_path: Path, beside: bool
) -> None:
    """``-----BEGIN X509 CERTIFICATE-----``, a label OpenSSL (curl's --cacert, Python's cadata)
    reads as a certificate: alone, the file was refused as holding none; beside plain ones, its
    CA was dropped unsaid and each call to a server it signed failed as untrusted."""
    old = private_ca.ca.read_bytes().replace(b" CERTIFICATE-----", b" X509 CERTIFICATE-----")
    assert old.count(b"X509 CERTIFICATE") == 2
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes((private_ca.other_ca.read_bytes() if beside else b"") + old)
    context = loaded({"ca_file": str(bundle)}).ca_context
    assert context is not None
    subjects = [ca["subject"] for ca in context.get_ca_certs()]
    assert ((("commonName", "Test private-ca"),),) in subjects
    assert len(subjects) == (2 if beside else 1)


def test_a_ca_file_that_cannot_serve_is_refused_at_load_naming_the_upstream_and_the_path(
    private_ca: PrivateCA, tmp_path: Path
) -> None:
    missing = tmp_path / "missing.pem"
    assert refusal({"ca_file": str(missing)}) == (
        f"upstreams.openai.ca_file: {missing}: cannot read it (No such file or directory)"
    )
    assert refusal({"ca_file": str(tmp_path)}) == (
        f"upstreams.openai.ca_file: {tmp_path}: cannot read it (Is a directory)"
    )
    key_only = tmp_path / "key-only.pem"
    key_only.write_bytes(private_ca.server_key.read_bytes())
    message = refusal({"ca_file": str(key_only)})
    assert message.startswith(f"upstreams.openai.ca_file: {key_only}: it holds no PEM certificate"), message
    assert "PRIVATE KEY" not in message and "BEGIN EC" not in message
    der = tmp_path / "ca.der"
    der.write_bytes(ssl.PEM_cert_to_DER_cert(private_ca.ca.read_text()))
    assert "openssl x509 -inform der" in refusal({"ca_file": str(der)})
    broken = tmp_path / "broken.pem"
    broken.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n")
    message = refusal({"ca_file": str(broken)})
    unread = f"upstreams.openai.ca_file: {broken}: a certificate in it cannot be read ("
    assert message.startswith(unread), message
    assert "_ssl.c" not in message


def test_a_ca_file_for_an_http_upstream_or_an_empty_path_is_refused(private_ca: PrivateCA) -> None:
    raw = base_config("http://vllm.internal:8000/v1", "redis://127.0.0.1:1/0")
    raw["upstreams"]["openai"]["ca_file"] = str(private_ca.ca)
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, {"TEST_UPSTREAM_KEY": "sk-k"})
    assert (
        str(caught.value)
        == "upstreams.openai: ca_file: the CAs of an https:// upstream; its base_url is http://"
    )
    assert "upstreams.openai.ca_file: an empty path" in refusal({"ca_file": ""})


def test_the_ledger_and_report_commands_do_not_read_it(tmp_path: Path) -> None:
    # They call no upstream: a CA file readable only where the proxy serves is none of theirs.
    upstream = loaded({"ca_file": str(tmp_path / "missing.pem")}, key_secrets=False)
    assert upstream.ca_context is None


def test_check_config_says_a_missing_ca_file_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.pem"
    path = tmp_path / "config.yaml"
    path.write_text(
        "upstreams:\n"
        f"  vllm: {{base_url: 'https://vllm.internal:8443/v1', ca_file: '{missing}'}}\n"
        "models:\n  '*': {upstream: vllm}\n"
    )
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"llm-billing-proxy: upstreams.vllm.ca_file: {missing}: cannot read it (No such file or directory)\n"
    )


@pytest.mark.parametrize("mixed", [True, False])
def test_a_ca_file_holding_openssl_trusted_certificates_is_refused_at_load(
    private_ca: PrivateCA, tmp_path: Path, mixed: bool
) -> None:
    """RHEL's ca-bundle.trust.crt form (a certificate and its trust settings), which Python's
    ``cadata`` cannot read: beside plain certificates, its CAs were dropped unsaid."""
    trusted = tmp_path / "trusted.pem"
    subprocess.run(
        [
            "openssl",
            "x509",
            "-in",
            str(private_ca.ca),
            "-trustout",
            "-addtrust",
            "serverAuth",
            "-out",
            str(trusted),
        ],
        check=True,
        capture_output=True,
    )
    bundle = tmp_path / "ca-bundle.trust.crt"
    bundle.write_bytes((private_ca.other_ca.read_bytes() if mixed else b"") + trusted.read_bytes())
    message = refusal({"ca_file": str(bundle)})
    assert message.startswith(
        f"upstreams.openai.ca_file: {bundle}: it holds 1 OpenSSL trusted certificate(s)"
    ), message
    assert "ca-bundle.crt" in message


@pytest.mark.parametrize(
    ("begin", "end"), [(b"X509 CERTIFICATE", b"CERTIFICATE"), (b"CERTIFICATE", b"X509 CERTIFICATE")]
)
def test_a_certificate_whose_begin_and_end_labels_differ_is_refused_naming_the_mismatch(
    private_ca: PrivateCA, tmp_path: Path, begin: bytes, end: bytes
) -> None:
    """BEGIN X509 CERTIFICATE ... END CERTIFICATE (or the reverse) was taken as one block, which
    OpenSSL refused in words naming neither ("no start line: cadata does not contain a
    certificate"): the mismatch is named (the fifth review)."""
    pem = private_ca.ca.read_bytes()
    pem = pem.replace(b"BEGIN CERTIFICATE", b"BEGIN " + begin).replace(b"END CERTIFICATE", b"END " + end)
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(pem)
    with pytest.raises(ConfigError) as refused:
        loaded({"ca_file": str(bundle)})
    message = str(refused.value)
    assert "cadata" not in message and "no start line" not in message, message
    assert "-----END " in message, message
