"""The CAs an upstream's TLS certificate is verified against: its own ``ca_file`` (a PEM file of
CA certificates), which replaces the system's as curl's ``--cacert`` and requests'
``verify=PATH`` do, for a private CA (an in-house server) or an egress proxy that re-signs the
providers' certificates with its own (Squid's ssl-bump).

Read here, once per load (``config_load.parse_config``, at start and at each reload: a file
changed under the same path is read again), its certificates kept in the config as PEM text, from
which the ``ssl.SSLContext`` the upstream's calls and its model list are sent with is built once
per config in each process (``UpstreamConfig.ca_context``, ``forward.UpstreamSending.tls``): a
context cannot be pickled, and ``serve --workers N`` sends each worker its config pickled.
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path

# A PEM certificate block. Taken out of the file rather than the file handed to OpenSSL whole: a
# bundle's comments may hold any text (certifi's name issuers in UTF-8), which ``cadata`` (ASCII
# PEM) refuses, and the refusals are then the proxy's words, not OpenSSL's for a path. The older
# label ``X509 CERTIFICATE`` too, which OpenSSL (curl's --cacert, cadata) reads as a certificate:
# a bundle holding some had their CAs dropped unsaid, each call to a server they signed failing.
_PEM_CERTIFICATE = re.compile(
    rb"-----BEGIN ((?:X509 )?CERTIFICATE)-----\r?\n.*?-----END ((?:X509 )?CERTIFICATE)-----", re.DOTALL
)
# OpenSSL's trusted certificate (a certificate followed by trust settings: the purposes it is
# trusted or distrusted for), as RHEL's ca-bundle.trust.crt holds them. ``cadata`` reads none, and
# one read as its certificate alone would trust a CA its settings distrust.
_PEM_TRUSTED = b"-----BEGIN TRUSTED CERTIFICATE-----"
_SSL_SOURCE = re.compile(r"\s*\(_ssl\.c:\d+\)$")


def trusted_pem(path: Path) -> str:
    """The certificates of ``path``, as PEM text a context can be built of (``trust_context``);
    ValueError in words naming neither the upstream nor the path (the caller's message does) when
    it cannot serve."""
    try:
        pem = path.read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read it ({err.strerror or type(err).__name__})") from None
    if trusted := pem.count(_PEM_TRUSTED):
        # Refused rather than dropped: the file's CAs in those blocks were missing from the
        # context unsaid, each call to a server they signed failing as untrusted.
        raise ValueError(
            f"it holds {trusted} OpenSSL trusted certificate(s) (-----BEGIN TRUSTED CERTIFICATE-----, "
            "as RHEL's ca-bundle.trust.crt), whose trust settings cannot be honoured here: give a "
            "bundle of plain certificates (RHEL's /etc/pki/tls/certs/ca-bundle.crt), or convert "
            "each with openssl x509 -in FILE -out FILE.pem (which drops its trust settings)"
        )
    found = list(_PEM_CERTIFICATE.finditer(pem))
    for block in found:
        if block[1] != block[2]:
            # OpenSSL would refuse it in its own words ("no start line"), naming neither.
            raise ValueError(
                f"a certificate's -----BEGIN {block[1].decode()}----- is closed by "
                f"-----END {block[2].decode()}-----: the two labels must be the same"
            )
    blocks = [block[0] for block in found]
    if not blocks:
        raise ValueError(
            "it holds no PEM certificate (-----BEGIN CERTIFICATE-----); a DER file converts with "
            "openssl x509 -inform der -in FILE -out FILE.pem"
        )
    try:
        cadata = b"\n".join(blocks).decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("a certificate in it holds a byte that is not PEM's (not ASCII)") from None
    trust_context(cadata)  # a certificate OpenSSL cannot read refuses the file here, at load
    return cadata


def trust_context(cadata: str) -> ssl.SSLContext:
    """The client context trusting the PEM certificates ``cadata`` and no other CA."""
    # As aiohttp's own default context (``_make_ssl_context``): verified, the host checked
    # against the certificate, HTTP/1.1 offered by ALPN. No default paths: the file replaces them.
    try:
        context = ssl.create_default_context(cadata=cadata)
    except ssl.SSLError as err:
        raise ValueError(f"a certificate in it cannot be read ({_SSL_SOURCE.sub('', str(err))})") from None
    context.set_alpn_protocols(("http/1.1",))
    return context
