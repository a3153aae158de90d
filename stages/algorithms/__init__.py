"""Algorithms, one per file: the pure loss kernel (docs/architecture.md, "The math contract") and the registered class
that trains with it (stages/algorithms/base.py describes the seam)."""
from unirl.stages.algorithms.aggregate import AGG_MODES, LossOutput
from unirl.stages.algorithms.base import Algorithm, BehaviourMismatchError, TrainContext, algorithms, get_algorithm
from unirl.stages.algorithms.drpo import drpo_loss
from unirl.stages.algorithms.flow_dppo import flow_dppo_loss
from unirl.stages.algorithms.flow_grpo import flow_grpo_loss
from unirl.stages.algorithms.grpo import grpo_loss
from unirl.stages.algorithms.gspo import gspo_loss
from unirl.stages.algorithms.kl import KL_ESTIMATORS, flow_kl, kl
from unirl.stages.algorithms.nft import nft_loss

__all__ = [
    "AGG_MODES", "Algorithm", "BehaviourMismatchError", "KL_ESTIMATORS", "LossOutput", "TrainContext", "algorithms",
    "drpo_loss", "flow_dppo_loss", "flow_grpo_loss", "flow_kl", "get_algorithm", "grpo_loss", "gspo_loss", "kl", "nft_loss",
]
