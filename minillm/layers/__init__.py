"""The model's building blocks: ``linear``, ``norm``, ``rotary``, ``attention``.  Each layer runs the implementation
it was given (``kernels.select``); the KV store attention writes to is an argument of the forward pass."""
