"""The HTTP server (FastAPI): OpenAI's Chat Completions, Completions, Responses and
Embeddings, rerank and score (pooling models), and Anthropic's Messages (Responses and
Messages built on chat), protocol models, the serving handlers,
errors, auth and body limits, metrics and memory reports. May import engine and below.
"""
