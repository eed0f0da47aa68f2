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


# Runs in a fresh interpreter: oneDNN and ideep read their cache capacities once, at first use.
_SHAPE_CACHE_PROBE = """
import gc, json, sys
import torch
from pkv.core.linear import Linear, prepack_linears
from pkv.core.memory import native_heap, release_free_memory

def in_use():
    gc.collect(); release_free_memory(); return native_heap().in_use_bytes

layer = Linear(576, [1536], False)
prepack_linears(layer)
with torch.inference_mode():
    for rows in range(1, 100):
        layer(torch.randn(rows, 576))
    warm = in_use()
    for rows in range(100, 300):  # 200 row counts never seen: a shape-keyed cache grows
        layer(torch.randn(rows, 576))
print(json.dumps({"growth": in_use() - warm}))
"""


def _shape_cache_growth(env: dict[str, str]) -> int:
    import json
    import os
    import subprocess
    import sys

    from pkv.core.memory import native_heap

    if native_heap() is None:
        pytest.skip("not glibc >= 2.33: no mallinfo2 to read the native heap")
    clean = {k: v for k, v in os.environ.items()
             if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", _SHAPE_CACHE_PROBE], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["growth"]


def test_packed_linears_shape_caches_stay_bounded_past_their_capacity():
    """A packed linear run at ever new row counts (a server's steps) holds at most its
    caches' 64 entries; at oneDNN's and ideep's own defaults (1024 each) the same run grows
    by tens of MiB: the slow climb a 10-minute soak showed."""
    bounded = _shape_cache_growth({})
    unbounded = _shape_cache_growth({"LRU_CACHE_CAPACITY": "1024",
                                     "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"})
    assert unbounded > 20 << 20, unbounded  # the probe can see the growth it guards against
    assert bounded < 4 << 20, bounded
