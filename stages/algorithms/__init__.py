"""Algorithms, one per file: the recipe's `algorithm:` section and the registered class that trains
with its loss kernel (stages/algorithms/base.py describes the seam; the kernels, torch math, are in
stages/kernels/). Reading a recipe imports these declarations and no torch."""
from unirl.stages.algorithms.base import Algorithm, TrainContext, get_algorithm
from unirl.stages.kernels.errors import BehaviourMismatchError
from unirl.stages.runtime.registry import algorithms

__all__ = ["Algorithm", "BehaviourMismatchError", "TrainContext", "algorithms", "get_algorithm"]
