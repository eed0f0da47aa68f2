"""oneDNN-packed float32 linears: same outputs as the plain layout, plain weights dropped."""

from __future__ import annotations

import pytest
import torch

from pkv.core.config import EngineConfig
from pkv.core.linear import Linear, prepack_linears
from pkv.core.llm_engine import LLMEngine

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_plain(rows: int, bias: bool):
    torch.manual_seed(rows)
    layer = Linear(48, [40, 24], bias)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        plain = layer(x)
        assert prepack_linears(layer) == 1
        packed = layer(x)
    assert layer.weight is None and layer.packed_weight.is_mkldnn
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)


def test_only_float32_cpu_layers_are_packed():
    layers = torch.nn.ModuleList([Linear(8, [8], False),
                                  Linear(8, [8], False, dtype=torch.bfloat16)])
    assert prepack_linears(layers) == 1
    assert layers[0].weight is None and layers[1].weight is not None


def test_engine_packs_every_float_linear_and_keeps_the_tied_embedding(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="4MiB"),
                       show_progress=False)
    model = engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None for m in linears)
    assert model.model.embed_tokens.weight.shape[0] == model.config.vocab_size
    # The packed LM head is a copy; both count in the weights' footprint.
    head = model.config.vocab_size * model.config.hidden_size * 4
    assert engine.runner.weight_bytes >= 2 * head
