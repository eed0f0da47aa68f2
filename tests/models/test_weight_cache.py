"""The converted-model cache: a GGUF converts once into a folder that later opens instead,
with the same tokenizer and weights; partial loads, corrupt entries and unwritable caches
never break loading."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pkv.core.layers.linear import as_tensor
from pkv.core.model_loader.loader import open_model
from pkv.core.model_loader.weight_cache import SafetensorsStream, converted_folder

TEXT = "The capital of France is Paris. 12 + 30 = 42 <|im_end|>"


@pytest.fixture
def gguf_copy(tmp_path: Path, smol_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the bundled GGUF (its mtime is ours to change) under a fresh cache root."""
    monkeypatch.setenv("PKV_CACHE_DIR", str(tmp_path / "cache"))
    return Path(shutil.copy(smol_gguf, tmp_path / "smol.gguf"))


def _weights(source, names: set[str]) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {n: as_tensor(t).clone() for n, t in source.weights() if n in names}


def test_gguf_converts_once_then_opens_from_the_cache(gguf_copy: Path):
    first = open_model(str(gguf_copy))
    folder = converted_folder(gguf_copy)
    assert not folder.exists()  # written while the weights load, not before
    names = {"model.embed_tokens.weight", "model.layers.3.self_attn.q_proj.weight",
             "model.norm.weight"}
    from_gguf = _weights(first, names)
    assert (folder / "model.safetensors").is_file()
    assert not [p for p in folder.parent.iterdir() if ".tmp-" in p.name]

    second = open_model(str(gguf_copy))
    assert second.name == first.name == "smol" and second.quantization == "gguf"
    assert second.config == first.config
    assert second.tokenizer.encode(TEXT) == first.tokenizer.encode(TEXT)
    assert second.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    cached = _weights(second, names)
    assert cached.keys() == names
    for name in names:
        assert torch.equal(cached[name], from_gguf[name]), name


def test_a_partial_load_leaves_no_cache(gguf_copy: Path):
    weights = open_model(str(gguf_copy)).weights()
    next(weights)
    weights.close()  # e.g. a load that failed half way
    cache = converted_folder(gguf_copy).parent
    assert not converted_folder(gguf_copy).exists()
    assert not cache.exists() or not any(cache.iterdir())


def test_a_corrupt_cache_entry_is_discarded(gguf_copy: Path):
    for _ in open_model(str(gguf_copy)).weights():
        pass
    data = converted_folder(gguf_copy) / "model.safetensors"
    with data.open("r+b") as f:
        f.truncate(1000)
    source = open_model(str(gguf_copy))  # falls back to the GGUF
    assert not converted_folder(gguf_copy).exists()
    assert sum(1 for _ in source.weights()) == source.num_tensors
    assert (converted_folder(gguf_copy) / "model.safetensors").stat().st_size > 1000


def test_a_changed_file_gets_a_new_key(gguf_copy: Path):
    before = converted_folder(gguf_copy)
    stat = gguf_copy.stat()
    os.utime(gguf_copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert converted_folder(gguf_copy) != before


def test_an_unwritable_cache_does_not_stop_loading(gguf_copy: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("PKV_CACHE_DIR", str(blocker))
    source = open_model(str(gguf_copy))
    assert sum(1 for _ in source.weights()) == source.num_tensors


def test_stream_writer_round_trips_and_checks_order(tmp_path: Path):
    tensors = {"a": torch.randn(3, 5), "b.weight": torch.randn(7), "c": torch.randn(2, 2, 2)}
    path = tmp_path / "x.safetensors"
    with path.open("wb") as f:
        stream = SafetensorsStream(f, [(n, tuple(t.shape)) for n, t in tensors.items()])
        for name, tensor in tensors.items():
            assert not stream.complete
            stream.write(name, tensor)
        assert stream.complete
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor)
    stream = SafetensorsStream(io.BytesIO(), [("a", (3, 5)), ("b", (7,))])
    with pytest.raises(ValueError, match=r"expected a \(3, 5\), got b"):
        stream.write("b", torch.zeros(7))
