"""`pkv serve` option handling: YAML config, flags over YAML, one-line errors."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from typer.testing import CliRunner

from pkv.cli.main import app
from pkv.core.model_loader.loader import bundled_model_path


def _serve(*args: str):
    return CliRunner().invoke(app, ["serve", *args])


def test_yaml_values_reach_the_engine_and_flags_win(tmp_path: Path, tiny_llama_dir: Path):
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {tiny_llama_dir}\nkv-cache-memory: 16KiB\nport: 0\n")
    from_yaml = _serve("--config", str(config))
    assert from_yaml.exit_code == 2 and "kv_cache_memory=16384 bytes" in from_yaml.output
    overridden = _serve("--config", str(config), "--kv-cache-memory", "32KiB")
    assert overridden.exit_code == 2 and "kv_cache_memory=32768 bytes" in overridden.output


def test_unknown_yaml_key_is_an_error(tmp_path: Path):
    config = tmp_path / "bad.yaml"
    config.write_text("max-num-seq: 4\n")
    result = _serve("--config", str(config))
    assert result.exit_code == 2 and "unknown option 'max-num-seq'" in result.output
    assert "Traceback" not in result.output
    config.write_text("gpu_memory_utilization: 0.5\n")  # a vLLM config's: what pkv has
    result = _serve("--config", str(config))
    assert result.exit_code == 2 and "pkv calls it memory_utilization" in result.stderr
    config.write_text("password_hash: x: y\n")
    result = _serve("--config", str(config))
    assert result.exit_code == 2 and result.stderr.count("\n") == 1  # one line
    assert "not valid YAML: mapping values are not allowed here (line 1, column 17)" in \
        result.stderr and "password_hash" not in result.stderr  # nor the file's text


def test_bad_flags_are_one_line_errors(tmp_path: Path):
    assert "does not exist" in _serve(str(tmp_path / "missing")).output
    result = _serve("--tensor-parallel-size", "0")
    assert result.exit_code == 2 and "tensor_parallel_size" in result.output


def test_every_recipe_passes_check() -> None:
    recipes = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
    assert len(recipes) >= 4
    for recipe in recipes:
        result = _serve("--config", str(recipe), "--check")
        assert result.exit_code == 0, (recipe.name, result.output)
        assert "config OK" in result.output


def test_a_shipped_recipe_is_found_by_name_and_a_missing_one_lists_them() -> None:
    by_name = _serve("--config", "smollm2-cpu", "--check")
    assert by_name.exit_code == 0 and "config OK" in by_name.output, by_name.output
    missing = _serve("--config", "no-such-recipe", "--check")
    assert missing.exit_code == 2 and "smollm2-cpu" in missing.output
    assert "Traceback" not in missing.output


@pytest.mark.parametrize("yaml, says", [
    ("max-num-seqs: abc", "max_num_seqs must be an integer, got 'abc'"),
    ("max-model-len: 1e3", "max_model_len must be an integer or unset, got '1e3'"),
    ("memory-utilization: '0.5'", "memory_utilization must be a number"),
    ("enable-prefix-caching: maybe", "enable_prefix_caching must be true or false"),
    ("seed: 99999999999999999999999", "seed must be a 64-bit integer"),
    ("api-key: 12345", "api_key must hold at least one key"),
    ("port: 1.5", "port must be an integer in [0, 65535], got 1.5"),
    ("shutdown-timeout: '30'", "shutdown_timeout must be a number, got '30'"),
    ("body-timeout: null", "body_timeout must be a number, got None"),
    ("host: 5", "host must be a string, got 5"),
    ("lora-modules: 5", "lora_modules must be a list of strings or unset, got 5"),
])
def test_yaml_values_of_the_wrong_type_are_one_line_errors(tmp_path: Path, yaml: str,
                                                          says: str) -> None:
    config = tmp_path / "typed.yaml"
    config.write_text(yaml + "\n")
    result = _serve("--config", str(config), "--check")
    assert result.exit_code == 2 and says in result.output, result.output
    assert "Traceback" not in result.output


def test_names_in_brackets_print_as_written(tmp_path: Path) -> None:
    """Paths and ids are text, not Rich markup: `[/bad]` once crashed the error line."""
    missing = _serve(str(tmp_path / "[/bad]"))
    assert missing.exit_code == 2 and "[/bad]" in missing.output
    assert "Traceback" not in missing.output
    remote = _serve("org/mod[v2]", "--check")
    assert remote.exit_code == 0 and "org/mod[v2]" in remote.output


def test_check_rejects_bad_configs_without_loading(tmp_path: Path, tiny_llama_dir: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: {tiny_llama_dir}\ntensor-parallel-size: 3\n")
    result = _serve("--config", str(bad), "--check")
    assert result.exit_code == 2 and "exceeds the model's 2 KV heads" in result.output
    bad.write_text("block-size: 0\n")
    result = _serve("--config", str(bad), "--check")
    assert result.exit_code == 2 and "block_size must be an integer in [1, 1024]" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("flag, value, says", [
    ("--guided-decoding-backend", "nope", "unknown guided decoding backend 'nope'"),
    ("--tool-call-parser", "nope", "unknown tool call parser 'nope'"),
    ("--reasoning-parser", "nope", "unknown reasoning parser 'nope'"),
])
def test_check_rejects_unknown_parsers_and_backends(flag: str, value: str, says: str) -> None:
    result = _serve(flag, value, "--check")
    assert result.exit_code != 0 and says in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("args, says", [
    (["--task", "classify"], "not a sequence classifier"),
    (["--task", "embed", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
     "does not run with speculative decoding"),
    (["--pipeline-parallel-size", "2", "--pp-layer-partition", "10,10"], "summing to the model's 30"),
])
def test_check_rejects_tasks_and_partitions_the_model_cannot_take(args: list[str],
                                                                  says: str) -> None:
    result = _serve(*args, "--check")
    assert result.exit_code != 0 and says in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("args, says", [
    (["--quantization", "nope"], "unknown quantization method 'nope'"),
    (["--attention-backend", "nope"], "unknown attention backend 'nope'; registered: "),
    (["--max-model-len", "99999999"], "exceeds the model's max_position_embeddings (8192)"),
    (["--max-body-bytes", "-1"], "max_body_bytes must be a positive integer"),
    (["--max-n", "0"], "max_n must be an integer >= 1"),
    (["--step-timeout", "0"], "step_timeout must be a positive number of seconds"),
    (["--api-key", " , "], "api_key must hold at least one key"),  # (would leave it open)
    (["--shutdown-timeout", "nan"], "shutdown_timeout must be a finite number"),
    (["--structured-outputs-timeout", "inf"], "structured_outputs_timeout must be > 0"),
    (["--kv-offload-dir", __file__], "is a file; name a folder"),
    ([str(bundled_model_path()), "--gguf-file", "other.gguf"],
     "needs a Hugging Face id or a folder"),
])
def test_check_rejects_what_serving_would(args: list[str], says: str) -> None:
    result = _serve(*args, "--check")
    assert result.exit_code != 0 and says in result.output and "Traceback" not in result.output


def test_plugins_refuses_an_unknown_device() -> None:
    result = CliRunner().invoke(app, ["plugins", "--device", "tpu"])
    assert result.exit_code == 2 and "--device must be cpu or cuda, got 'tpu'" in result.stderr


def test_a_taken_port_or_a_foreign_host_is_refused_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _serve("--port", str(port))
    assert result.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "pkv serve" not in result.output  # (the summary printed once the model is up)
    result = _serve("--host", "999.1.1.1", "--port", "0")
    assert result.exit_code == 2 and "cannot listen on 999.1.1.1:0" in result.stderr
    for port in ("70000", "-1"):  # (socket's OverflowError was a traceback)
        result = _serve("--port", port)
        assert result.exit_code == 2 and "port must be an integer in [0, 65535]" in \
            result.stderr
    result = _serve("--port", "0", "--enable-lora", "--lora-dir", "/nonexistent/adapters")
    assert result.exit_code == 2 and "--lora-dir /nonexistent/adapters is not a folder" in \
        result.stderr
    # what --check refuses, a real start refuses before loading too
    for args, says in ((["--log-level", "warn"], "log_level must be debug, info"),
                       (["--tool-call-parser", "nope"], "unknown tool call parser 'nope'"),
                       (["--reasoning-parser", "nope"], "nope")):
        result = _serve("--port", "0", *args)
        assert result.exit_code == 2 and says in result.stderr, args
        assert "pkv serve" not in result.output and "Traceback" not in result.output


def test_a_key_of_the_wrong_type_is_refused_without_being_echoed(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("api-key: [sk-tenant-a-SECRET, sk-tenant-b-SECRET]\n")
    result = _serve("--config", str(config), "--check")
    assert result.exit_code == 2 and "api_key must hold at least one key" in result.output
    assert "SECRET" not in result.output


def test_accepted_connections_send_without_waiting_for_acks() -> None:
    # asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets that name TCP; those
    # accepted from a listening socket made without it held a response's body back until the
    # client's delayed ACK came: ~40 ms on every request of a kept-alive connection.
    from pkv.cli.serve import _listening_socket

    async def nodelay_of_an_accepted_connection() -> int:
        sock = _listening_socket("127.0.0.1", 0)
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def handle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connection = writer.get_extra_info("socket")
            accepted.set_result(connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        async with await asyncio.start_server(handle, sock=sock):
            _, writer = await asyncio.open_connection(*sock.getsockname())
            nodelay = await asyncio.wait_for(accepted, 10)
            writer.close()
        return nodelay

    assert asyncio.run(nodelay_of_an_accepted_connection()) != 0


def test_config_files_that_are_folders_bytes_or_scalars_for_lists(tmp_path: Path) -> None:
    result = _serve("--config", str(tmp_path), "--check")
    assert result.exit_code == 2 and "is a folder; name a YAML file in it" in result.stderr
    binary = tmp_path / "serve.yaml"
    binary.write_bytes(b"\xf9\x00\x01")
    result = _serve("--config", str(binary), "--check")
    assert result.exit_code == 2 and f"{binary} is not a text (UTF-8) file" in result.stderr
    # one value where a list goes is a list of one, as the flag given once (it was read
    # character by character: "NAME=PATH, got 'a'")
    binary.write_text("lora-modules: a=/adapters/a\n")
    result = _serve("--config", str(binary), "--check")
    assert result.exit_code == 2 and "need --enable-lora" in result.stderr
    # --allow-runtime-lora: --enable-runtime-lora's other name
    result = _serve("--allow-runtime-lora", "--check")
    assert result.exit_code == 2 and "need --enable-lora" in result.stderr


def test_version_and_output_files_whose_folder_is_missing(tmp_path: Path) -> None:
    from pkv import __version__

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"pkv {__version__}"
    missing = tmp_path / "no-such-folder" / "figures.json"
    for args, says in ((["bench", "run", "--json", str(missing)], "'--json': the folder"),
                       (["inspect-cache", "--simulate", "--png", str(missing)],
                        "'--png': the folder"),
                       (["bench", "run", "--dataset", str(tmp_path)], "is a directory"),
                       (["bench", "run", "--warmup", "-1"], "greater than or equal to 0")):
        result = CliRunner().invoke(app, args)  # refused before any run, not after it
        shown = " ".join(result.output.replace("│", " ").split())  # (the box's lines joined)
        assert result.exit_code == 2 and says in shown, (args, result.output)


def test_a_keyless_server_off_loopback_is_flagged_in_its_summary() -> None:
    from pkv.cli.serve import _open_auth

    for host in ("127.0.0.1", "::1", "localhost"):
        assert _open_auth(host) == "none (loopback only)"
    for host in ("0.0.0.0", "10.1.2.3", "myhost.example"):
        assert "anyone who reaches it" in _open_auth(host) and host in _open_auth(host)


def test_the_summarys_concurrency_counts_every_kv_groups_blocks(tmp_path: Path,
                                                               smol_hf_dir: Path,
                                                               monkeypatch) -> None:
    # A sliding-window model holds blocks in its windowed group as well as its global one.
    import re
    from types import SimpleNamespace

    from rich.console import Console

    from pkv.cli import serve
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.llm_engine import LLMEngine
    from pkv.tests.helpers import build_tiny_model

    hybrid = build_tiny_model(tmp_path / "qwen2", smol_hf_dir, "qwen2", sliding_window=16,
                              use_sliding_window=True, max_window_layers=1)
    engine = LLMEngine(EngineConfig(model=str(hybrid), kv_cache_memory="1MiB",
                                    max_model_len=256), show_progress=False)
    assert len(engine.runner.kv_groups.groups) == 2
    printed = Console(record=True, width=200)
    monkeypatch.setattr(serve, "console", printed)
    server = SimpleNamespace(served_model_name="tiny", api_key=None)
    serve._print_summary(engine, server, {"host": "127.0.0.1", "port": 8000})
    shown = float(re.search(r"([\d.]+)x at max_model_len", printed.export_text())[1])
    # 256 tokens: 16 blocks in the global group, the window's 16 + one step's chunk in the
    # other (the budget: 256 tokens), capped at 16
    assert shown == round(engine.runner.num_blocks / 32, 1)
