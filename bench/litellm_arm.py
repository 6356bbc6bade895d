"""The optional LiteLLM arm of ``bench/run.py --litellm``: the LiteLLM proxy in front of the same
fake upstream, driven by the same load generator, for the issue's "throughput at least 25 times
the LiteLLM proxy's on the same machine and work".

LiteLLM is not a dependency of this project. It lives in its own venv (default
``bench/.litellm-venv``, git-ignored), created on first use with ``python3 -m venv`` and
``pip install 'litellm[proxy]==1.82.6'``. The version is pinned exactly and checked before every
start: LiteLLM 1.82.7 and 1.82.8 on PyPI were a credential-stealing supply-chain compromise, so
this module installs nothing else of it and refuses to run any other installed version.

The proxy runs on loopback only, one uvicorn worker unless ``--workers N`` (then ``--num_workers
N``), with a one-model config routing ``gpt-4o-mini`` to the fake upstream as an OpenAI-compatible
provider, and with an environment that keeps it offline and quiet: a clean environment (no
``DATABASE_URL``, no provider keys, no proxy variables inherited), the bundled model cost map
and other bundled tables instead of their GitHub copies (``LITELLM_LOCAL_*``), ``--telemetry
False``, ``LITELLM_LOG=WARNING`` and a uvicorn log config at WARNING (no access log line per
request: that favours LiteLLM, so the ratio is conservative). No master key, no database: no
auth and no spend logs, LiteLLM's cheapest configuration.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from bench.procstats import ROOT, Server, wait_http_ok
from proxy.redis_server import free_port

LITELLM_VERSION = "1.82.6"  # exactly: 1.82.7 and 1.82.8 were a supply-chain compromise
REQUIREMENT = f"litellm[proxy]=={LITELLM_VERSION}"
DEFAULT_VENV = ROOT / "bench" / ".litellm-venv"
MODEL = "gpt-4o-mini"
START_TIMEOUT_S = 180.0
INSTALL_TIMEOUT_S = 1200.0

# Keep LiteLLM off the network and quiet (read from litellm's source, 1.82.6).
OFFLINE_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # bundled model_prices_and_context_window.json
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_LOCAL_BLOG_POSTS": "True",
    "LITELLM_LOCAL_POLICY_TEMPLATES": "True",
    "LITELLM_LOG": "WARNING",
    "DISABLE_ADMIN_UI": "True",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}
UVICORN_LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr"}},
    "loggers": {
        name: {"handlers": ["stderr"], "level": "WARNING", "propagate": False}
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
    },
}


class Unavailable(Exception):
    """LiteLLM could not be installed or started: the run goes on without its arm."""


def _say(message: str) -> None:
    print(f"bench: litellm: {message}", file=sys.stderr, flush=True)


def installed_version(venv: Path) -> str | None:
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    probe = "import importlib.metadata as m; print(m.version('litellm'))"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60)
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def ensure_venv(venv: Path) -> Path:
    """The ``litellm`` executable of ``venv``, creating the venv and installing the pinned
    version first if it is missing. Raises ``Unavailable``."""
    version = installed_version(venv)
    if version is None:
        base = shutil.which("python3") or sys.executable
        if not (venv / "bin" / "python").exists():
            _say(f"creating {venv} ({base} -m venv)")
            made = subprocess.run([base, "-m", "venv", str(venv)], capture_output=True, text=True)
            if made.returncode != 0:
                raise Unavailable(f"python3 -m venv {venv} failed: {made.stderr.strip()[-500:]}")
        _say(f"installing '{REQUIREMENT}' into {venv} (a few minutes, once)")
        try:
            pip = subprocess.run(
                [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", REQUIREMENT],
                capture_output=True,
                text=True,
                timeout=INSTALL_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise Unavailable(f"pip install '{REQUIREMENT}' took over {INSTALL_TIMEOUT_S:.0f}s") from None
        if pip.returncode != 0:
            errors = [line for line in pip.stderr.splitlines() if not line.startswith("WARNING: Location")]
            raise Unavailable(f"pip install '{REQUIREMENT}' failed: {' '.join(errors)[-800:]}")
        version = installed_version(venv)
    if version != LITELLM_VERSION:
        raise Unavailable(
            f"{venv} has litellm {version}, not {LITELLM_VERSION}: refusing to run it (1.82.7 and "
            f"1.82.8 were compromised releases); remove the venv to have {LITELLM_VERSION} installed"
        )
    executable = venv / "bin" / "litellm"
    if not executable.exists():
        raise Unavailable(f"{executable} missing (is the [proxy] extra installed?)")
    return executable


def config(upstream_url: str, upstream_key: str) -> dict[str, object]:
    return {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",  # an OpenAI-compatible provider
                    "api_base": upstream_url,  # the fake upstream's .../v1
                    "api_key": upstream_key,
                },
            }
        ],
        "litellm_settings": {"telemetry": False},
        "general_settings": {},
    }


def _smoke(url: str) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "ping"}]}).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": "Bearer sk-bench-open"},
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        answer = json.loads(resp.read())
    if not answer.get("choices"):
        raise OSError(f"no choices in {str(answer)[:200]}")


def start(venv: Path, workdir: Path, upstream_url: str, upstream_key: str, workers: int | None) -> Server:
    """Start the LiteLLM proxy on loopback and wait until it answers a chat completion."""
    executable = ensure_venv(venv)
    home = workdir / "litellm-home"
    home.mkdir(exist_ok=True)
    config_path = workdir / "litellm.yaml"
    config_path.write_text(yaml.safe_dump(config(upstream_url, upstream_key)))
    log_config = workdir / "litellm-uvicorn-log.json"
    log_config.write_text(json.dumps(UVICORN_LOG_CONFIG))
    port = free_port()
    argv = [
        str(executable),
        "--config",
        str(config_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--telemetry",
        "False",
        "--log_config",
        str(log_config),
        "--num_workers",
        str(workers or 1),
    ]
    env = {
        "PATH": f"{executable.parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "TMPDIR": os.environ.get("TMPDIR", "/tmp"),
        "LANG": "C.UTF-8",
        **OFFLINE_ENV,
    }
    log_path = workdir / "litellm.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=str(home), env=env
        )
    url = f"http://127.0.0.1:{port}"
    server = Server("litellm", process, url, log_path)
    started = time.monotonic()
    try:
        wait_http_ok(url + "/health/liveliness", server, timeout_s=START_TIMEOUT_S)
        if process.poll() is not None:
            raise OSError(f"exited with code {process.returncode}")
        _smoke(url)
    except (OSError, urllib.error.URLError, ValueError) as err:
        server.stop()
        raise Unavailable(f"the LiteLLM proxy did not start ({err}): {server.log_tail(1500)}") from None
    except BaseException:
        server.stop()  # a SIGTERM's SystemExit while it starts: no caller holds it yet to stop it
        raise
    _say(f"LiteLLM {LITELLM_VERSION} ready at {url} (pid {process.pid}) in {time.monotonic() - started:.0f}s")
    return server
