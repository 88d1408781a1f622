"""The OpenAI-compatible server: ``protocol`` (request/response models), ``engine_loop`` (the thread that owns
the engine), ``metrics`` (Prometheus), ``sse`` (a response's ``StepOutput``s as OpenAI's streamed chunks; pure,
exercise 9.3), ``server`` (FastAPI app, ``build_app``, ``run_server``).  Importing this package imports nothing
heavy; ``server`` needs the ``serve`` extra (fastapi, uvicorn, prometheus_client)."""
