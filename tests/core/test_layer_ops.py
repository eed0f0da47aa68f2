"""The fused C++ layer operations (csrc/layer_ops_cpu.cpp) against the torch code they
replace: RMSNorm with and without the residual add, RoPE on strided views, SiLU-and-mul."""

from __future__ import annotations

import pytest
import torch

from pkv.core.config.engine import EngineConfig
from pkv.core.distributed.parallel import single_rank_plan
from pkv.core.engine.llm_engine import LLMEngine
from pkv.core.layers.mlp import GatedMLP as MLP
from pkv.core.layers.norm import RMSNorm
from pkv.core.layers.rotary import RotaryEmbedding
from pkv.core.models.config import ModelConfig
from pkv.csrc import cpp_build



def _norm(width: int) -> RMSNorm:
    norm = RMSNorm(width, 1e-5)
    norm.weight.data = torch.randn(width)
    return norm


@pytest.mark.parametrize("rows,width", [(1, 576), (5, 40), (70, 17)])
def test_rms_norm_matches_torch(rows: int, width: int, cpu_kernels):
    torch.manual_seed(width)
    norm, x = _norm(width), torch.randn(rows, width) * 3
    expected = norm(x)
    norm.kernel = cpu_kernels
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,width", [(1, 576), (33, 24)])
def test_add_rms_norm_updates_both_in_place(rows: int, width: int, cpu_kernels):
    torch.manual_seed(rows)
    norm, x, residual = _norm(width), torch.randn(rows, width), torch.randn(rows, width)
    want_h, want_residual = norm.add_forward(x.clone(), residual.clone())
    norm.kernel = cpu_kernels
    h, new_residual = norm.add_forward(x, residual)
    assert h.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(new_residual, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(h, want_h, rtol=1e-5, atol=1e-6)


def _config(head_dim: int, **extra: object) -> ModelConfig:
    heads = 4
    return ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": heads * head_dim,
        "intermediate_size": 40, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 256,
        "rope_theta": 10000.0, **extra})


def _rope(cfg: ModelConfig, max_len: int) -> RotaryEmbedding:
    return RotaryEmbedding(cfg.rope_spec(), cfg.head_dim, max_len)


@pytest.mark.parametrize("head_dim", [64, 6])
def test_rotary_on_views_of_a_fused_qkv(head_dim: int, cpu_kernels):
    rope = _rope(_config(head_dim), 256)
    torch.manual_seed(head_dim)
    qkv = torch.randn(9, 8 * head_dim)  # q: 4 heads, k: 2, v: 2
    positions = torch.tensor([0, 1, 2, 100, 255, 7, 7, 31, 64])

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = t.split([4 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)
        return q.view(9, 4, head_dim), k.view(9, 2, head_dim)

    want_q, want_k = rope(positions, *views(qkv))
    rope.kernel = cpu_kernels
    reference, got = qkv.clone(), rope(positions, *views(qkv))
    torch.testing.assert_close(got[0], want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want_k, rtol=1e-5, atol=1e-6)
    assert torch.equal(qkv[:, 6 * head_dim:], reference[:, 6 * head_dim:])  # v untouched
    assert got[0].data_ptr() == qkv.data_ptr()  # rotated in place


def test_rotary_rejects_a_position_past_the_table(cpu_kernels):
    rope = _rope(_config(8), 16)
    rope.kernel = cpu_kernels
    q, k = torch.zeros(1, 4, 8), torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="position 16 outside the table"):
        rope(torch.tensor([16]), q, k)


@pytest.mark.parametrize("rows,size", [(1, 1536), (3, 40), (64, 23)])
def test_silu_and_mul_matches_torch(rows: int, size: int, cpu_kernels):
    torch.manual_seed(size)
    gate_up = torch.randn(rows, 2 * size) * 8
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp under/overflow
    out = torch.empty(rows, size)
    cpu_kernels.silu_and_mul(out, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=1e-6)
    assert torch.isfinite(out).all()


def test_mlp_with_the_kernel_matches_torch(cpu_kernels):
    cfg = _config(16)
    plan = single_rank_plan(cfg)
    mlp = MLP(cfg.hidden_size, plan.intermediate, "silu", None, plan)
    torch.manual_seed(0)
    for p in mlp.parameters():
        p.data = torch.randn_like(p) * 0.2
    x = torch.randn(5, cfg.hidden_size)
    expected = mlp(x)
    mlp.kernel = cpu_kernels
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)


def test_engine_uses_the_kernels_for_float32_only(tiny_llama_dir, isa: str):
    config = EngineConfig(model=str(tiny_llama_dir), max_model_len=128, kv_cache_memory="4MiB")
    float32 = LLMEngine(config, show_progress=False)
    # PKV_CPU_ISA (set by the fixture) picks the flavour the engine runs.
    assert float32.runner.model.model.norm.kernel is cpp_build.kernels(isa)
    bf16 = LLMEngine(EngineConfig(model=str(tiny_llama_dir), max_model_len=128,
                                  kv_cache_memory="4MiB", dtype="bfloat16"), show_progress=False)
    assert bf16.runner.model.model.norm.kernel is None


@pytest.mark.parametrize("gemma", [False, True])
def test_head_norm_on_views_of_a_fused_qkv(gemma: bool, cpu_kernels):
    from pkv.core.layers.norm import GemmaRMSNorm

    torch.manual_seed(3)
    qkv = torch.randn(7, 8 * 16)  # q: 4 heads of 16, k: 2, v: 2
    q = qkv[:, :64].view(7, 4, 16)
    norm = (GemmaRMSNorm if gemma else RMSNorm)(16, 1e-6)
    norm.weight.data = torch.randn(16) * 0.3
    want = norm(q)  # the torch path: q is a strided view
    norm.kernel = cpu_kernels
    torch.testing.assert_close(norm(q), want, rtol=1e-5, atol=1e-6)
    whole = (GemmaRMSNorm if gemma else RMSNorm)(64, 1e-6)  # over the whole projection
    want = whole(qkv[:, :64])
    whole.kernel = cpu_kernels
    torch.testing.assert_close(whole(qkv[:, :64]), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,size", [(1, 40), (9, 128)])
def test_gelu_tanh_and_mul_matches_torch(rows: int, size: int, cpu_kernels):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * size) * 4
    out = torch.empty(rows, size)
    cpu_kernels.gelu_tanh_and_mul(out, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_partial_rotary_leaves_the_other_dims(cpu_kernels):
    cfg = _config(16, partial_rotary_factor=0.5, architectures=["Phi3ForCausalLM"])
    rope = _rope(cfg, 64)
    assert rope.spec.rotary_dim == 8
    torch.manual_seed(5)
    qkv = torch.randn(6, 8 * 16)
    positions = torch.tensor([0, 3, 9, 17, 40, 63])

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = t.split([64, 32, 32], dim=-1)
        return q.view(6, 4, 16), k.view(6, 2, 16)

    before = qkv.clone()
    want_q, want_k = rope(positions, *views(before.clone()))
    rope.kernel = cpu_kernels
    got_q, got_k = rope(positions, *views(qkv))
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_q[..., 8:], views(before)[0][..., 8:])  # the unrotated half
