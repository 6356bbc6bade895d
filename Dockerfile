# llm-billing-proxy: slim image with an embedded redis-server for the zero-setup default.
FROM python:3.11-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 proxy \
 && mkdir -p /data /etc/llm-billing-proxy \
 && chown proxy /data

WORKDIR /app
COPY pyproject.toml README.md ./
COPY proxy ./proxy
RUN pip install --no-cache-dir .
COPY config/docker.yaml /etc/llm-billing-proxy/config.yaml

USER proxy
# Where relative paths land (the journal's and the embedded Redis's defaults, in a config
# mounted over ours): on the volume, which the user owns; /app is root's.
WORKDIR /data
EXPOSE 8080
VOLUME ["/data"]
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status == 200 else 1)"

# Mount your own config over /etc/llm-billing-proxy/config.yaml; secrets come from env vars
# (OPENAI_API_KEY, proxy keys named by key_env, REDIS_URL for an external Redis).
ENTRYPOINT ["llm-billing-proxy"]
CMD ["serve", "--config", "/etc/llm-billing-proxy/config.yaml"]
