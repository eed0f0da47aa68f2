"""Finding and loading a model: a local folder, a GGUF file or a Hub id (`hub`), the
quantization interface that weight-loader plugins implement (`quantization.WeightLoader`),
and `loader` (build the model, load its weights). May import
models, layers, tokenizer, config and below.
"""
