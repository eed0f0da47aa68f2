"""The OpenAI-compatible HTTP server (FastAPI): protocol models, the serving handlers,
errors, auth and body limits, metrics and memory reports. May import engine and below.
"""
