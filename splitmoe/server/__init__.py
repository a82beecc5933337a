"""The OpenAI-compatible HTTP server: FastAPI app, engine thread, Prometheus metrics."""
