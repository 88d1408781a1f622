"""Models: the Llama-family decoder (``llama``), the loader (hub id, directory, .gguf, the embedded default) and
the GQA/MQA conversions and KV calculators of notebook 03 (``attention_variants``)."""
