"""llm-billing-proxy: an OpenAI-compatible reverse proxy that makes the bill true."""
