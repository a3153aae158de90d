"""Policy losses, one family per file. Every loss returns a LossOutput (loss, metrics)."""
from stages.algorithms.aggregate import AGG_MODES, LossOutput
from stages.algorithms.drpo import drpo_loss
from stages.algorithms.grpo import grpo_loss
from stages.algorithms.gspo import gspo_loss
from stages.algorithms.kl import KL_ESTIMATORS, kl
from stages.algorithms.flow_dppo import flow_dppo_loss
from stages.algorithms.flow_grpo import flow_grpo_loss, flow_kl
from stages.algorithms.nft import nft_loss
