"""A GGUF's weights stay in its block formats: resident near the file's size (mapped from it),
the token embedding and the tied LM head included; bad tensors are refused in one line that
names them, before any weight loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from pkv.core.model_loader.loader import open_model


def test_the_bundled_gguf_stays_at_its_size(smol_llm, smol_gguf: Path):
    from pkv.core.layers.ggml_linear import GGMLLinearMethod

    runner = smol_llm.llm_engine.runner
    by_type = runner.weight_bytes_by_type
    # Q4_1 linears repacked for the 4-bit kernel, the Q8_0 embedding as stored, float32 norms
    assert set(by_type) == {"Q4_1 as 4-bit tiles", "Q8_0", "float32"}
    assert by_type["float32"] < 1 << 20
    assert runner.weight_bytes <= 1.15 * smol_gguf.stat().st_size
    model = runner.model
    assert isinstance(model.lm_head.method, GGMLLinearMethod)  # tied: the embedding's Q8_0
    assert model.lm_head.parts[0] is model.model.embed_tokens.table
    assert model.model.embed_tokens.weight.numel() == 0


def test_peak_rss_stays_near_the_file(smol_gguf: Path):
    # A fresh process, loading included. Its peak is VmHWM, of its own address space:
    # getrusage's ru_maxrss survives exec, so it would report the pytest worker that forked it.
    code = ("from pathlib import Path\nfrom pkv import LLM, SamplingParams\n"
            "llm = LLM(kv_cache_memory='64MiB', max_model_len=256, show_progress=False)\n"
            "llm.generate(['Hello there'], SamplingParams(max_tokens=8, temperature=0))\n"
            "status = Path('/proc/self/status').read_text().splitlines()\n"
            "print(next(line.split()[1] for line in status if line.startswith('VmHWM')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    peak = int(done.stdout.strip().splitlines()[-1]) * 1024
    # the weights, the KV cache, and the interpreter with torch and the kernels (~230 MiB
    # here); a header read into a numpy view per vocabulary string would add 160 MiB
    budget = 1.15 * smol_gguf.stat().st_size + (64 << 20) + (400 << 20)
    assert peak <= budget, f"peak RSS {peak / 2**20:.0f} MiB > {budget / 2**20:.0f} MiB"


def _tensor_info_part(reader: gguf.GGUFReader, name: str, index: int) -> int:
    """Byte offset in the file of part `index` of tensor `name`'s info (1: name, 3: dims,
    4: type, 5: offset)."""
    tensor = next(t for t in reader.tensors if t.name == name)
    return tensor.field.parts[index].ctypes.data - reader.data.ctypes.data


def _patched(src: Path, dst: Path, name: str, part: int, value: np.ndarray) -> Path:
    reader = gguf.GGUFReader(str(src))
    at = _tensor_info_part(reader, name, part)
    raw = bytearray(src.read_bytes())
    raw[at:at + value.nbytes] = value.tobytes()
    dst.write_bytes(bytes(raw))
    return dst


@pytest.mark.parametrize(("type_id", "message"), [
    (99, r"GGUF tensor blk\.0\.attn_q\.weight: unknown tensor type id 99"),
    (16, r"GGUF tensor blk\.0\.attn_q\.weight is IQ2_XXS, which pkv does not run"),
    (12, (r"GGUF tensor blk\.0\.attn_q\.weight: rows of 576 values are not whole Q4_K "
          r"blocks of 256")),
])
def test_a_bad_tensor_type_is_one_line_naming_the_tensor(tmp_path: Path, smol_gguf: Path,
                                                         type_id: int, message: str):
    bad = _patched(smol_gguf, tmp_path / "bad.gguf", "blk.0.attn_q.weight", 4,
                   np.array([type_id], dtype=np.uint32))
    with pytest.raises(ValueError, match=message) as caught:
        open_model(str(bad))
    assert "\n" not in str(caught.value)


def test_a_tensor_past_the_end_is_one_line_naming_it(tmp_path: Path, smol_gguf: Path):
    reader = gguf.GGUFReader(str(smol_gguf))
    last = max(reader.tensors, key=lambda t: t.data_offset)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smol_gguf.read_bytes()[:last.data_offset + last.n_bytes // 2])
    with pytest.raises(ValueError, match=rf"GGUF tensor {last.name} .* past the file's end"):
        open_model(str(cut))
