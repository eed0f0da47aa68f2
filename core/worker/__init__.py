"""Running the model: the `ModelRunner` (a `SchedulerOutput` in, sampled tokens out), the
fused C++ decoder, worker processes (tensor-parallel shards, pipeline stages), weights on
huge pages, the native heap and the step timer. May import sched, model_loader, models,
layers, sample, pooling, lora and below.
"""
