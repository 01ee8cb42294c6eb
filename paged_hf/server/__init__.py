"""OpenAI-compatible HTTP server over ``PagedEngine`` (FastAPI + uvicorn; ``pip install 'paged_hf[server]'``)."""
