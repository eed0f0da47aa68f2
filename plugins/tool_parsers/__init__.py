"""Built-in tool-call parsers, one per model family's format (registered by pkv.plugins.builtin)."""
