"""`pkv inspect-cache --simulate` and the snapshot it renders."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from pkv import LLM, SamplingParams
from pkv.cli.main import app
from pkv.core.sched.cache_inspector import SHARED, take_snapshot


def test_snapshot_shows_shared_prefix_blocks(tiny_llama_dir: Path):
    llm = LLM(str(tiny_llama_dir), kv_cache_memory="8MiB", show_progress=False)
    engine = llm.llm_engine
    prefix = list(range(100, 132))  # two full blocks
    for i in range(3):
        engine.add_request(f"r{i}", prefix + [200 + i, 300 + i], SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    snap = take_snapshot(engine)
    assert [r.shared for r in snap.requests] == [[True, True, False]] * 3
    assert snap.block_map.count(SHARED) == 2
    assert snap.used == 2 + 3 and snap.free + snap.cached_free + snap.used == snap.num_blocks
    assert snap.tokens_stored == 32 + 3 * 2 and snap.slots_allocated == 5 * 16
    assert 0 <= snap.fragmentation < 1
    assert snap.prefix_cache_hits == 2 * 32  # the 2nd and 3rd request reuse two blocks each
    engine.generate_until_done()
    after = take_snapshot(engine)
    assert after.used == 0 and after.cached_free >= 2 and after.requests == []


def test_simulate_renders_tables_map_and_png(tmp_path: Path, tiny_llama_dir: Path):
    png = tmp_path / "map.png"
    result = CliRunner().invoke(app, [
        "inspect-cache", "--simulate", "--model", str(tiny_llama_dir), "--requests", "4",
        "--shared-prefix-len", "32", "--unique-len", "5", "--output-len", "6",
        "--kv-cache-memory", "8MiB", "--kv-cache-dtype", "int8", "--max-model-len", "256",
        "--png", str(png)])
    assert result.exit_code == 0, result.output
    for text in ("prefix hit rate", "fragmentation", "block tables", "block map", "shared",
                 "int8"):
        assert text in result.output
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_needs_exactly_one_source():
    result = CliRunner().invoke(app, ["inspect-cache"])
    assert result.exit_code == 2 and "either --url" in result.stderr
    assert "error" not in result.stdout  # stdout stays for what a script reads


def test_a_folder_for_the_picture_is_refused(tmp_path: Path):
    result = CliRunner().invoke(app, ["inspect-cache", "--simulate", "--png", str(tmp_path)])
    assert result.exit_code == 2 and "Invalid value for '--png'" in result.output
    assert not tmp_path.with_suffix(".png").exists()  # matplotlib's own choice of name


def test_server_mode_refuses_simulation_options_and_bad_urls():
    result = CliRunner().invoke(app, ["inspect-cache", "--url", "http://127.0.0.1:9",
                                      "--requests", "3", "--block-size", "32"])
    assert result.exit_code == 2 and "--requests, --block-size: for --simulate only" in \
        result.stderr
    result = CliRunner().invoke(app, ["inspect-cache", "--url", "http://[::1"])
    assert result.exit_code == 2 and "cannot reach http://[::1" in result.stderr
    assert "Traceback" not in result.output


def test_a_picture_path_with_a_tilde_is_the_home_folders(tmp_path: Path, tiny_llama_dir: Path,
                                                         monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # (`--png=~/map.png`: no shell expands it)
    result = CliRunner().invoke(app, [
        "inspect-cache", "--simulate", "--model", str(tiny_llama_dir), "--requests", "2",
        "--output-len", "2", "--kv-cache-memory", "8MiB", "--max-model-len", "256",
        "--png=~/map.png"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "map.png").read_bytes()[:4] == b"\x89PNG"


def test_help_answers_to_h_and_a_backend_needs_its_device():
    import torch

    assert CliRunner().invoke(app, ["-h"]).exit_code == 0
    assert CliRunner().invoke(app, ["run-batch", "-h"]).exit_code == 0
    shown = CliRunner().invoke(app, ["plugins", "--device", "cuda"]).output
    torch_row = next(line for line in shown.splitlines() if "│ torch" in line)
    assert ("no CUDA/ROCm device" in torch_row) == (not torch.cuda.is_available())
