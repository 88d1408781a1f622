"""The server's default limits on one client, in one place (the command line's defaults; no imports, so the CLI
can name them without loading the server stack).  Each says where its value comes from."""

DEFAULT_MAX_BODY_BYTES = 4 << 20  # a 2k-token context is ~10 kB of text; 4 MiB leaves room for token-id batches
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0  # uvicorn's default
DEFAULT_TIMEOUT_HEADERS_S = 10.0  # nginx's client_header_timeout is 60 s; a loopback or LAN client needs far less
DEFAULT_MAX_HEADER_BYTES = 16 << 10  # h11's default max_incomplete_event_size; nginx allows 4 × 8 KiB buffers
DEFAULT_STALL_TIMEOUT_S = 60.0  # a large model's step on a busy CPU takes seconds; a minute without one is stuck
