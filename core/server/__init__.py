"""The HTTP server (FastAPI): OpenAI's Chat Completions, Completions and Responses and
Anthropic's Messages (the last two built on chat), protocol models, the serving handlers,
errors, auth and body limits, metrics and memory reports. May import engine and below.
"""
