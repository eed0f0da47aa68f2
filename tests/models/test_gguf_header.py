"""pkv's GGUF header reader against the `gguf` package's reader (the format's reference
implementation): the same fields and tensors, on the bundled file and on one that holds every
value type; hostile headers refused in one line, in bounded memory."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import psutil
import pytest

from pkv.core.model_loader.loader import open_model
from pkv.plugins.weights.gguf_header import read_header


def _assert_same_as_the_gguf_package(path: Path) -> None:
    theirs = gguf.GGUFReader(str(path))
    ours = read_header(path)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == fields
    assert [(t.name, t.dims, t.type_id, t.start) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), t.data_offset)
        for t in theirs.tensors]
    last = theirs.tensors[-1]
    assert ours.tensor_bytes(last.data_offset, last.n_bytes).tobytes() == \
        last.data.tobytes()


def test_the_bundled_file_reads_as_the_gguf_package_reads_it(smol_gguf: Path):
    _assert_same_as_the_gguf_package(smol_gguf)


def test_every_value_type_and_an_alignment_read_as_written(tmp_path: Path):
    path = tmp_path / "values.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    for i, kind in enumerate(("uint8", "int8", "uint16", "int16", "uint32", "int32",
                              "uint64", "int64")):
        getattr(writer, f"add_{kind}")(f"test.{kind}", -i if kind.startswith("int") else i)
    writer.add_float32("test.float32", 1e-6)
    writer.add_float64("test.float64", 1e-300)
    writer.add_bool("test.bool", True)
    writer.add_string("test.string", "héllo ▁wörld")
    writer.add_array("test.strings", ["a", "", "ü" * 40])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_array("test.empty", [])
    writer.add_tensor("a.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.add_tensor("b.weight", np.ones((3, 5), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_same_as_the_gguf_package(path)
    header = read_header(path)
    assert header.fields["test.string"] == "héllo ▁wörld"
    assert header.fields["test.ints"] == [1, -2, 3]
    assert all(t.start % 64 == 0 for t in header.tensors)


def _header(version: int = 3, fields: bytes = b"", field_count: int = 0,
            tensors: bytes = b"", tensor_count: int = 0) -> bytes:
    return (b"GGUF" + struct.pack("<IQQ", version, tensor_count, field_count) + fields
            + tensors)


def _string(text: str, claimed: int | None = None) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw) if claimed is None else claimed) + raw


HOSTILE = {
    "version 1": (_header(version=1), "GGUF version 1; pkv reads versions 2 and 3"),
    "big-endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    "huge array": (_header(fields=_string("k") + struct.pack("<IIQ", 9, 8, 2**60),
                           field_count=1), "longer than the file"),
    "huge number array": (_header(fields=_string("k") + struct.pack("<IIQ", 9, 4, 2**58),
                                  field_count=1), "past the file's end"),
    "huge string": (_header(fields=_string("k") + struct.pack("<I", 8) + _string("v", 2**62),
                            field_count=1), "past the file's end"),
    "unknown value type": (_header(fields=_string("k") + struct.pack("<I", 77) + b"\0" * 8,
                                   field_count=1), "unknown metadata value type 77"),
    "bad alignment": (_header(fields=_string("general.alignment") + struct.pack("<II", 4, 48),
                              field_count=1), "general.alignment 48 is not a power of two"),
    "too many dims": (_header(tensors=_string("t") + struct.pack("<I", 9) + b"\0" * 90,
                              tensor_count=1), "tensor t has 9 dimensions"),
    "not utf-8": (_header(fields=struct.pack("<Q", 2) + b"\xff\xfe" + struct.pack("<IB", 0, 1),
                          field_count=1), "is not UTF-8"),
    "cut short": (_header(field_count=5), "past the file's end"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_header_is_one_line_in_bounded_memory(tmp_path: Path, case: str):
    raw, message = HOSTILE[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(raw)
    rss = psutil.Process().memory_info().rss
    with pytest.raises(ValueError, match="is not a readable GGUF file") as caught:
        open_model(str(path))
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)
    assert psutil.Process().memory_info().rss - rss < 64 * 2**20
