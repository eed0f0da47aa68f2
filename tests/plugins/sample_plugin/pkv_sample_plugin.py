"""A third-party attention backend: the torch reference, counting its calls."""

from pkv.core.hookspecs import hookimpl
from pkv.core.registry import AttentionBackendSpec
from pkv.plugins.attention.torch_backend import TorchAttentionBackend


class CountingBackend(TorchAttentionBackend):
    name = "sample"
    calls = 0

    def forward(self, *args, **kwargs):
        CountingBackend.calls += 1
        return super().forward(*args, **kwargs)


@hookimpl
def pkv_attention_backends():
    return [AttentionBackendSpec("sample", "pkv_sample_plugin:CountingBackend", ("cpu",),
                                 description="sample third-party backend")]
