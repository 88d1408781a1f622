"""From logits to tokens: ``params`` (SamplingParams, vLLM's meanings) and ``sampler`` (temperature, top-k, top-p)."""
