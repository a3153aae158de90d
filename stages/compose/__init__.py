"""Composed runs: a prompt-enhancer pipeline (two models in sequence) and a unified model (one
backbone, two losses)."""
