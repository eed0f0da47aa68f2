"""Parallelism's vocabulary: the tensor-parallel rank group (`TPGroup`) and how a model's
sizes split over ranks (`ShardPlan`, planned from any object with a model's sizes); pipeline
stages, their layer partition and the point-to-point sends between them (`pipeline`).
Imports nothing of pkv's.
"""
