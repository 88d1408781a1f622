"""What the notebooks share: ``checks/`` (one checker module per notebook) and ``slot_model`` (notebook 06)."""
