"""The engine: runs StepPlans on the model (engine.py), the per-rank work (runner.py), plan ->
device batch (batch.py), decode CUDA graphs (cuda_graph.py), the sampler (sampler.py, its torch
ops in sampling_ops.py)."""

from ..config import EngineConfig
from .batch import InvalidPlan
from .engine import Engine

__all__ = ["Engine", "EngineConfig", "InvalidPlan"]
