"""Levers that shrink a model instead of spreading it: pruning, early exit, distillation (notebook 10)."""
