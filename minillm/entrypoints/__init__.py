"""Ways in from outside Python: ``cli`` (``python -m minillm ...``)."""
