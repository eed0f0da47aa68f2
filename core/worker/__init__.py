"""Running the model: the `ModelRunner` (a `SchedulerOutput` in, sampled tokens out) and the
`PipelineModelRunner` (one pipeline stage's), what is decided before the weights load
(model_setup.py), the KV pool's size (kv_pool_size.py), a step's flattened batch
(input_batch.py), the fused C++ decoder, worker processes (tensor-parallel shards, pipeline
stages) and their parts of KV blocks for the disk tier (kv_parts.py), weights on huge pages,
the native heap and the step timer. May import sched, model_loader, models, layers, sample,
pooling, lora and below.
"""
