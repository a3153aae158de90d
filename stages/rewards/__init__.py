"""Rewards: the scorer interface (`base`), rule-based and model-based scorers, and the reward
service (`server`, `client`)."""
from unirl.stages.rewards.base import (
    AGGREGATIONS,
    ScoreBatch,
    Scorer,
    ScorerError,
    ScoreResult,
    aggregate,
    build_scorer,
    register_scorer,
    run_scorer,
    scorer_names,
)

__all__ = [
    "AGGREGATIONS", "ScoreBatch", "ScoreResult", "Scorer", "ScorerError", "aggregate",
    "build_scorer", "register_scorer", "run_scorer", "scorer_names",
]
