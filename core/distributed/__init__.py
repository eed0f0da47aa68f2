"""Tensor parallelism's vocabulary: the rank group (`TPGroup`) and how a model's sizes split
over ranks (`ShardPlan`, planned from any object with a model's sizes). Imports nothing of
pkv's.
"""
