"""The math of the run, on tensors, with nothing of the run around it (docs/architecture.md, "The
math contract"): group advantages, loss aggregation, KL estimators, the token and flow policy
losses, the off-policy correction's weights, the behaviour check. Each states its formula in its
docstring and has hand-computed tests. This package's own import loads nothing heavy; its modules
import torch."""
