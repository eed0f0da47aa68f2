"""A third-party plugin distribution, installed into a throwaway folder, is discovered,
listed and selectable; a plugin that fails to import is reported and skipped."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SAMPLE = Path(__file__).parent / "sample_plugin"


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    target = tmp_path_factory.mktemp("site")
    source = tmp_path_factory.mktemp("src") / "sample_plugin"
    shutil.copytree(SAMPLE, source)  # the build leaves files beside its source
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(source)],
                   check=True, capture_output=True)
    return str(target)


def _run(plugin_path: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": plugin_path, "COLUMNS": "200"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_pkv_plugins_lists_third_party_and_broken(plugin_path: str):
    result = _run(plugin_path, "-m", "pkv.cli.main", "plugins")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "pkv-sample-plugin" in out and "0.3.0" in out and "attention:sample" in out
    assert "broken" in out and "failed: ImportError" in out
    assert "attention:cpu" in out  # the built-ins still load
    assert "speculative decoding" in out and "LoRA adapters" in out


def test_selecting_the_third_party_backend(plugin_path: str, tiny_llama_dir: Path):
    code = f"""
from pkv import LLM, SamplingParams
import pkv_sample_plugin
llm = LLM({str(tiny_llama_dir)!r}, kv_cache_memory="8MiB", attention_backend="sample",
          show_progress=False)
ref = LLM({str(tiny_llama_dir)!r}, kv_cache_memory="8MiB", attention_backend="torch",
          show_progress=False)
p = SamplingParams(temperature=0, max_tokens=5)
a = llm.generate([[5, 6, 7, 8]], p)[0].outputs[0].token_ids
b = ref.generate([[5, 6, 7, 8]], p)[0].outputs[0].token_ids
assert a == b, (a, b)
try:  # (it reads value rows only: the spec says nothing of int8 / fp8 caches)
    LLM({str(tiny_llama_dir)!r}, kv_cache_memory="8MiB", attention_backend="sample",
        kv_cache_dtype="int8", show_progress=False)
except ValueError as exc:
    assert "reads no int8 / fp8 KV cache" in str(exc), exc
else:
    raise AssertionError("an int8 cache reached a backend that reads value rows only")
print("calls", pkv_sample_plugin.CountingBackend.calls)
"""
    result = _run(plugin_path, "-c", code)
    assert result.returncode == 0, result.stderr
    calls = int(result.stdout.split("calls")[-1])
    assert calls >= 5 * 2  # every layer of every step went through the plugin


def test_unknown_backend_lists_usable_ones(tiny_llama_dir: Path):
    from pkv import LLM

    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'; usable here: .*cpu"):
        LLM(str(tiny_llama_dir), kv_cache_memory="8MiB", attention_backend="nope")


def test_the_old_plugin_import_paths_still_work_and_say_where_the_interface_moved():
    script = ("import warnings\n"
              "warnings.simplefilter('error', DeprecationWarning)\n"
              "try:\n"
              "    import pkv.plugins.hookspecs\n"
              "except DeprecationWarning as w:\n"
              "    print('warned:', w)\n"
              "warnings.simplefilter('ignore')\n"
              "from pkv.plugins.hookspecs import hookimpl\n"
              "from pkv.plugins.registry import AttentionBackendSpec\n"
              "import pkv.core.hookspecs as h, pkv.core.registry as r\n"
              "print(hookimpl is h.hookimpl, AttentionBackendSpec is r.AttentionBackendSpec)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "warned: pkv.plugins.hookspecs moved to pkv.core.hookspecs" in result.stdout
    assert "True True" in result.stdout
