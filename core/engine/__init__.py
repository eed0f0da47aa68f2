"""The engine's faces: `LLMEngine` (one `step()` at a time), `AsyncLLM` (a background
thread, a stream per request), `LLM` (the offline API); the input processor (prompts in,
validated requests out), the output processor and the `RequestOutput`s it builds, and the
pipeline's micro-batches in flight (`MicroBatches`). May import every room but server.
"""
