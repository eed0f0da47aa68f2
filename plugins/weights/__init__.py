"""Weight loaders: GGUF files, AutoAWQ 4-bit and FP8 checkpoints, each a `WeightLoader` with the
`LinearMethod` its layers compute with.
"""
