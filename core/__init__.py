"""The engine, in rooms by concern (vLLM's names). Data flows one way:

    server -> engine -> sched / worker / spec_decode -> sample, pooling, structured_output,
    lora, model_loader -> models -> layers -> distributed, config, tokenizer -> kernels (pkv.csrc)

A room imports only from rooms below it, or from its peers on one line where no two modules
import each other. Nothing here imports `pkv.plugins`: plugins register into the interfaces
defined here (`hookspecs`, `registry`, `layers.linear.LinearMethod`,
`layers.attention_backend.AttentionBackend`, `model_loader.quantization.WeightLoader`, ...).
tests/test_import_layers.py enforces both.

At this level: the plugin interface (`hookspecs`, `registry`) and progress bars.
"""
