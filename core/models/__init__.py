"""One short file per model family, composed from `core.layers`; `config.ModelConfig` (a
model's architecture) and `registry` (which architecture runs where). May import layers and
what they may.
"""
