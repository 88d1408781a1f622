"""The engine: ``llm_engine`` joins ``scheduler`` (which tokens run), ``model_runner`` (one packed forward + sampling)
and ``detokenizer``; ``sequence`` holds a request's state; ``simple`` has the naive and cached teaching loops."""
