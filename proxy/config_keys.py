"""The configuration of API keys (``keys:``, ``admin_keys:``): each key's secret, given as a
SHA-256 digest or an environment variable, and the tenant and tier its calls belong to.
"""

from __future__ import annotations

import re

from pydantic import field_validator, model_validator

from proxy.config_base import PASSTHROUGH_TENANT, PASSTHROUGH_TENANT_ID, Frozen


def _check_digest(value: str | None) -> str | None:
    if value is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", value):
        raise ValueError("must be a 64-character hex SHA-256 digest")
    return value.lower() if value else value


class KeyConfig(Frozen):
    name: str
    sha256: str | None = None
    key_env: str | None = None
    tenant: str
    tier: str = "standard"

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, value: str | None) -> str | None:
        return _check_digest(value)

    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", value):
            raise ValueError("tenant names use letters, digits, '.', '_' and '-' (at most 64)")
        if value == PASSTHROUGH_TENANT or PASSTHROUGH_TENANT_ID.fullmatch(value):
            raise ValueError(
                f"{value!r} is reserved for pass-through callers ('{PASSTHROUGH_TENANT}' and 'pt-' "
                "with 12 or 32 hex digits): name the tenant otherwise"
            )
        return value

    @field_validator("name")
    @classmethod
    def _key_name(cls, value: str) -> str:
        # Part of Redis keys, of the lease record (one scope key a line) and of log lines.
        if not re.fullmatch(r"[A-Za-z0-9._@/+-]{1,128}", value):
            raise ValueError("key names use letters, digits and '.', '_', '@', '/', '+', '-' (at most 128)")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> KeyConfig:
        if (self.sha256 is None) == (self.key_env is None):
            raise ValueError("give exactly one of sha256 or key_env")
        return self


class AdminKeyConfig(Frozen):
    """A key for operator-only endpoints (``/metrics`` on the main port)."""

    name: str
    sha256: str | None = None
    key_env: str | None = None

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, value: str | None) -> str | None:
        return _check_digest(value)

    @model_validator(mode="after")
    def _one_source(self) -> AdminKeyConfig:
        if (self.sha256 is None) == (self.key_env is None):
            raise ValueError("give exactly one of sha256 or key_env")
        return self
