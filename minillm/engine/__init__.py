"""The engine: ``llm_engine`` joins ``scheduler`` (which tokens run), the runner ``runners`` picks once
(``model_runner``: one packed forward + sampling; ``cuda_graph``, ``native_runner``: the fast decode paths),
``spec_decode`` (drafts as scheduled tokens) and ``detokenizer``; ``sequence`` holds a request's state; ``simple``
has the naive and cached teaching loops."""
