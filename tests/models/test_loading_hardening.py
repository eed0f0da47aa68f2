"""Hostile weights files: refused with one clear error, in bounded memory, never executed."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import psutil
import pytest

from pkv.core.model_loader.loader import open_model

ROOT = Path(__file__).resolve().parents[2]


def _rewrite_header(src: Path, dst: Path, edit) -> None:  # noqa: ANN001
    raw = src.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    dst.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size:])


def _first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


@pytest.mark.parametrize("case", ["bad_offsets", "shape_bytes_mismatch", "huge_header"])
def test_malformed_safetensors_are_clear_errors(tmp_path: Path, tiny_llama_dir: Path,
                                                case: str) -> None:
    folder = tmp_path / case
    shutil.copytree(tiny_llama_dir, folder)
    weights = folder / "model.safetensors"
    if case == "huge_header":  # claims a 1 TiB header: must not be allocated
        weights.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    elif case == "bad_offsets":
        _rewrite_header(tiny_llama_dir / "model.safetensors", weights, lambda h: h[
            _first_tensor(h)].update(data_offsets=[0, 10**12]))
    else:
        _rewrite_header(tiny_llama_dir / "model.safetensors", weights, lambda h: h[
            _first_tensor(h)].update(shape=[4096, 4096]))
    rss = psutil.Process().memory_info().rss
    with pytest.raises(ValueError, match="is not a valid safetensors file"):
        open_model(str(folder))
    assert psutil.Process().memory_info().rss - rss < 64 * 2**20


def test_truncated_gguf_is_a_clear_error(tmp_path: Path, smol_gguf: Path) -> None:
    truncated = tmp_path / "cut.gguf"
    with smol_gguf.open("rb") as f:
        truncated.write_bytes(f.read(20_000_000))
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        open_model(str(truncated))


def _q8_gguf_at_attn_q(tmp_path: Path, model_dir: Path, tokenizer: Path
                       ) -> tuple[bytearray, int]:
    """A Q8_0 GGUF of `model_dir` as bytes, and where blk.0.attn_q.weight's n_dims sits in
    its header (its dims follow, then its type)."""
    from pkv.tests.gguf_writer import write_gguf

    written = write_gguf(model_dir, tmp_path / "q8.gguf", "Q8_0", tokenizer)
    raw = bytearray(written.read_bytes())
    name = b"blk.0.attn_q.weight"
    return raw, raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)


def test_a_tensor_that_runs_into_the_next_is_a_clear_error(tmp_path: Path, tiny_llama_dir: Path,
                                                          smol_gguf: Path) -> None:
    raw, at = _q8_gguf_at_attn_q(tmp_path, tiny_llama_dir, smol_gguf)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    struct.pack_into("<I", raw, at + 4 + 8 * n_dims, 0)  # Q8_0 -> F32: 3.8x the bytes
    (tmp_path / "overlap.gguf").write_bytes(raw)
    with pytest.raises(ValueError, match="blk.0.attn_q.weight .* runs into") as caught:
        open_model(str(tmp_path / "overlap.gguf"))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("field, method", [
    ("attention.head_count", "add_head_count"), ("embedding_length", "add_embedding_length"),
    ("attention.head_count_kv", "add_head_count_kv"), ("context_length", "add_context_length")])
def test_a_zero_count_in_a_gguf_is_a_clear_error(tmp_path: Path, field: str, method: str
                                                 ) -> None:
    from pkv.tests.gguf_writer import write_fields_gguf

    fields = {"add_block_count": 1, "add_context_length": 128, "add_embedding_length": 64,
              "add_feed_forward_length": 128, "add_head_count": 4, "add_head_count_kv": 2}
    path = write_fields_gguf(tmp_path / "zero.gguf", "llama", {**fields, method: 0})
    with pytest.raises(ValueError, match=f"llama.{field} is 0; not a readable GGUF") as caught:
        open_model(str(path)).config  # noqa: B018 - reading it is the check
    assert "\n" not in str(caught.value)


_SMALL_LLAMA = {"add_block_count": 1, "add_context_length": 128, "add_embedding_length": 64,
                "add_feed_forward_length": 128, "add_head_count": 4, "add_head_count_kv": 2}


def _llama_metadata_gguf(path: Path, **fields: object) -> Path:
    """A llama GGUF of `_SMALL_LLAMA`'s fields and `fields` (raw key: value), with a token
    embedding so that its config reads as far as the architecture's own fields."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    for method, value in _SMALL_LLAMA.items():
        getattr(writer, method)(value)
    for key, value in fields.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value),
                             sub_type=gguf.GGUFValueType.UINT32 if isinstance(value, list)
                             else None)
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("fields, message", [
    ({"llama.expert_count": 4}, "lacks llama.expert_used_count"),  # a Mixtral half written
    ({"llama.attention.head_count_kv": [2]}, r"head_count_kv is \[2\], not one number"),
    ({"split.count": 3}, "one of 3 parts of a split GGUF"),
])
def test_odd_metadata_is_a_one_line_error(tmp_path: Path, fields: dict, message: str) -> None:
    path = _llama_metadata_gguf(tmp_path / "odd.gguf", **fields)
    with pytest.raises(ValueError, match=message) as caught:
        open_model(str(path)).config  # noqa: B018 - reading it is the check
    assert "\n" not in str(caught.value)


def test_a_shape_past_int64_is_named_not_wrapped(tmp_path: Path, tiny_llama_dir: Path,
                                                 smol_gguf: Path) -> None:
    raw, at = _q8_gguf_at_attn_q(tmp_path, tiny_llama_dir, smol_gguf)
    struct.pack_into("<Q", raw, at + 4 + 8, 2**62)  # rows x 2^62 values: 0 bytes in int64
    (tmp_path / "huge.gguf").write_bytes(raw)
    with pytest.raises(ValueError, match="blk.0.attn_q.weight .* past the file's end"):
        open_model(str(tmp_path / "huge.gguf"))


def test_remote_code_is_never_run(tmp_path: Path, tiny_llama_dir: Path) -> None:
    folder = tmp_path / "remote"
    shutil.copytree(tiny_llama_dir, folder)
    marker = tmp_path / "pwned"
    (folder / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    config["trust_remote_code"] = True
    (folder / "config.json").write_text(json.dumps(config))
    source = open_model(str(folder))
    assert source.config.architecture == "llama"
    from pkv import LLM

    LLM(str(folder), kv_cache_memory="8MiB", max_model_len=64, show_progress=False)
    assert not marker.exists()


def test_no_check_in_pkv_is_an_assert() -> None:
    """`python -O` strips asserts; checks must be explicit in everything but the tests."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".venv", "build") or "site-packages" in rel.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"\s*assert\b", line):
                offenders.append(f"{rel}:{number}")
    assert offenders == []
