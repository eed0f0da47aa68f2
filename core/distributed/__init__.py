"""Tensor parallelism's vocabulary: the rank group (`TPGroup`) and how a model's sizes split
over ranks (`ShardPlan`). May import config and models' `ModelConfig`.
"""
