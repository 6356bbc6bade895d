"""The proxy's exceptions, one small tree::

    ProxyError
    ├── ConfigError            invalid config file or flags (never reaches a client)
    ├── StoreError             Redis unreachable -> 503
    │   └── StoreRejected      a script refused its input: retrying will not help
    └── ApiError               answered to the client in OpenAI's error format
        ├── BadRequest         400 invalid_request_error
        ├── Unauthorized       401 invalid_api_key
        ├── Forbidden          403 permission_denied
        ├── NotFound           404 not_found
        ├── UnknownId          404 without a code: a stored id the provider does not know
        ├── BodyTimedOut       408 request_timeout (the connection closes with it)
        ├── BodyTooLarge       413 body_too_large
        ├── BudgetExceeded     429 insufficient_quota / budget_exceeded
        ├── UpstreamKeyUnset   502 upstream_error / upstream_auth (the call was not forwarded)
        ├── StoreUnavailable   503 service_unavailable (the call was not forwarded)
        └── Busy               503 proxy_busy (too much long work waiting for the threads)

Upstream failures are not exceptions of ours: they are outcomes of a call (see ``outcome``).
"""

from __future__ import annotations


class ProxyError(Exception):
    """Base of every error raised by the proxy itself."""


class ConfigError(ProxyError):
    """The configuration is invalid; the message names the field."""


class StoreError(ProxyError):
    """The store could not be reached or refused a script."""

    def __init__(self, message: str, *, maybe_applied: bool = False) -> None:
        super().__init__(message)
        # True when the command may have run and only its reply was lost (a timeout, a reset).
        self.maybe_applied = maybe_applied


class StoreRejected(StoreError):
    """A script returned an error (bad input): the same call would fail again."""


class ApiError(ProxyError):
    status = 400
    error_type = "invalid_request_error"
    code: str | None = None
    closes_connection = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}


class BadRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401
    code = "invalid_api_key"


class Forbidden(ApiError):
    status = 403
    error_type = "permission_denied"


class NotFound(ApiError):
    status = 404
    code = "not_found"


class UnknownId(ApiError):
    """As OpenAI answers an id it keeps nothing under (a conversation, an item, a container):
    its 404 carries no code."""

    status = 404


class BodyTimedOut(ApiError):
    status = 408
    code = "request_timeout"
    # The rest of the body may still come: the connection's framing is lost with it.
    closes_connection = True

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"The request body did not arrive whole within {timeout_s:g} s.")


class BodyTooLarge(ApiError):
    status = 413
    code = "body_too_large"

    def __init__(self) -> None:
        super().__init__("The request body is too large.")


class BudgetExceeded(ApiError):
    status = 429
    error_type = "insufficient_quota"
    code = "budget_exceeded"


class UpstreamKeyUnset(ApiError):
    """The operator's upstream key would authorize the call, and its variable is unset: sent
    without it, the provider's 401 would tell the caller its own key was wrong."""

    status = 502
    error_type = "upstream_error"
    code = "upstream_auth"

    def __init__(self) -> None:
        super().__init__(
            "The proxy has no key for the upstream (its environment variable is not set); "
            "the call was not forwarded.",
            # Not one a retry mends: the variable is read at start and on a reload.
            headers={"x-should-retry": "false"},
        )


class StoreUnavailable(ApiError):
    status = 503
    error_type = "service_unavailable"
    code = "store_unavailable"

    def __init__(
        self, message: str = "The billing store is unavailable; the call was not forwarded."
    ) -> None:
        super().__init__(message, headers={"x-should-retry": "true", "retry-after": "1"})


class Busy(ApiError):
    """More long work (large bodies to parse, prompts to count) waits for the process's threads
    than it takes (``thread_pools.TenantPool``): a retry, a moment later, is served."""

    status = 503
    error_type = "service_unavailable"
    code = "proxy_busy"

    def __init__(self) -> None:
        super().__init__(
            "The proxy is busy with other calls' large requests; the call was not forwarded.",
            headers={"x-should-retry": "true", "retry-after": "1"},
        )


def error_object(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, str | None]:
    """OpenAI's error object, the ``error`` of its error body."""
    return {"message": message, "type": error_type, "param": param, "code": code}
