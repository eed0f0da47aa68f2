"""The HTTP server (FastAPI): OpenAI's Chat Completions, Completions, Responses and
Embeddings, rerank, score and classify (pooling models), and Anthropic's Messages (Responses
and Messages built on chat), protocol models, the serving handlers, errors, auth, body and
header deadlines, metrics and memory reports, and OpenAI's Batch API file format answered
through the app. May import engine and below.
"""
