"""The HTTP routes, one module per API: each `add_routes` puts its routes on the app, over the
serving objects they call (core/server/serving_*.py); `api_server.build_app` calls them all.

    chat.py       /v1/chat/completions, /v1/completions, /v1/models
    responses.py  /v1/responses (create, get, input_items, delete, cancel)
    messages.py   /v1/messages, /v1/messages/count_tokens (Anthropic)
    pooling.py    /v1/embeddings, rerank, score, classify
    adapters.py   /v1/load_lora_adapter, /v1/unload_lora_adapter
    tokens.py     /tokenize, /detokenize
    ops.py        /health, /ping, /metrics, /version, /admin/*
"""
