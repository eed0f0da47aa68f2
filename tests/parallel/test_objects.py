"""Objects between ranks: a step's inputs round-trip whole, and a tensor that was on a GPU is
rebuilt on the receiving process's own device, never on the sender's (a CUDA tensor pickled
by torch comes back on the GPU it left)."""

from __future__ import annotations

import io
import pickle

import torch

from pkv.core.distributed import objects


def test_a_step_like_object_round_trips() -> None:
    step = {"ids": torch.arange(5), "meta": [torch.ones(2, 3)], "n": 3, "s": "x"}
    back = objects.loads(objects.dumps(step))
    assert torch.equal(back["ids"], step["ids"]) and torch.equal(back["meta"][0], step["meta"][0])
    assert (back["n"], back["s"]) == (3, "x")


def test_a_gpu_tensor_travels_as_host_memory_for_the_receivers_device(monkeypatch) -> None:
    # No GPU here: what the pickler writes for one, read as pickle would, names the
    # rebuild-on-my-device function with host memory (not torch's "cuda:0" storage).
    tensor = torch.arange(4.0)
    reduced = objects._Pickler(io.BytesIO()).reducer_override(tensor)
    assert reduced is NotImplemented  # a CPU tensor pickles as torch pickles it
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    rebuild, (host,) = objects._Pickler(io.BytesIO()).reducer_override(tensor)
    monkeypatch.undo()
    assert rebuild is objects._on_local_device and host.device.type == "cpu"
    assert torch.equal(rebuild(host), tensor)  # (this process has no GPU: it stays here)
    assert pickle.loads(pickle.dumps((rebuild, host)))[1].device.type == "cpu"
