"""The engine's faces: `LLMEngine` (one `step()` at a time), `AsyncLLM` (a background
thread, a stream per request), `LLM` (the offline API); the input processor (prompts in,
validated requests out), the output processor and the `RequestOutput`s it builds, the
pipeline's micro-batches in flight (`MicroBatches`), and what a step moves for the KV disk
tier (disk_tier.py). May import every room but server.
"""
