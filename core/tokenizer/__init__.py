"""Text <-> token ids: the tokenizer with its chat template and special tokens, and the
incremental detokenizer. Imports nothing of pkv's but each other.
"""
