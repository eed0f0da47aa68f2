"""Shared fixtures: the bundled SmolLM2 (GGUF and a safetensors copy), tiny random models."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from pkv.core.model_loader.loader import bundled_model_path
from pkv.csrc import cpp_build
from pkv.tests.helpers import build_tiny_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors only interpreted; set before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (`make test`: two workers) the workers share the cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
if "PKV_CACHE_DIR" not in os.environ:
    # Converted models go to a cache of this run only (workers inherit it), never ~/.cache.
    os.environ["PKV_CACHE_DIR"] = tempfile.mkdtemp(prefix="pkv-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PKV_CACHE_DIR"], ignore_errors=True)

# Every ISA flavour of the C++ kernels this CPU executes (AVX2 code runs on AVX-512 CPUs), so
# one machine checks what AVX2-only and baseline machines will run; none without a toolchain.
KERNEL_FLAVOURS = [] if cpp_build.unusable_reasons() else cpp_build.runnable_flavours()


_BUILDERS = pytest.StashKey[list[subprocess.Popen]]()
_BUILD_IN_BACKGROUND = ("import sys\nfrom pkv.csrc import cpp_build\n"
                        "for flavour in sys.argv[1:]: cpp_build.kernels(flavour)")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the kernel flavours in the background from the start, on both cores: the
    default one is ready about when the first engine asks for it (~70 s, one core), the
    others build beside it and then beside the tests. A test that needs a flavour still
    being built waits on torch's build lock."""
    if not KERNEL_FLAVOURS or "PYTEST_XDIST_WORKER" in os.environ:  # workers: the controller's
        return
    default = cpp_build.selected_flavour()
    others = [f for f in KERNEL_FLAVOURS if f != default]
    session.config.stash[_BUILDERS] = [
        subprocess.Popen([sys.executable, "-c", _BUILD_IN_BACKGROUND, *flavours],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for flavours in ([default], others) if flavours]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files that run a flavour other than the default go last, so that its build (started
    at the session's start) is done before they ask for it instead of holding both workers
    (`make test` keeps this order: --no-loadscope-reorder)."""
    default = cpp_build.selected_flavour() if KERNEL_FLAVOURS else None

    def other_flavour(item: pytest.Item) -> bool:
        params = getattr(item, "callspec", None)
        return params is not None and params.params.get("isa", default) != default

    late = {item.path for item in items if other_flavour(item)}
    items.sort(key=lambda item: item.path in late)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for builder in session.config.stash.get(_BUILDERS, []):
        try:
            builder.wait(timeout=300)  # a build cut short would leave its lock behind
        except subprocess.TimeoutExpired:
            builder.kill()


@pytest.fixture(params=KERNEL_FLAVOURS or [None])
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs the test once per kernel flavour, with PKV_CPU_ISA set so engines use it too."""
    if request.param is None:
        pytest.skip("no C++ toolchain to build the kernels")
    monkeypatch.setenv("PKV_CPU_ISA", request.param)
    return request.param


@pytest.fixture
def cpu_kernels(isa: str):  # noqa: ANN201 - the compiled module
    """The kernels module of each flavour in turn."""
    kernels = cpp_build.kernels(isa)
    assert kernels.isa.startswith(isa)
    return kernels


@pytest.fixture
def two_threads():  # noqa: ANN201 - a context for the test
    """Two torch threads for the test (the suite runs one a worker): the decoder's team
    (csrc/team.h) and the kernels' splits of work between threads need two."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


# Prompts of different lengths (3 to ~60 tokens) for batched parity runs.
PROMPTS = [
    "Hi there",
    "The capital of France is",
    "Write a haiku about the ocean and the moon.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three colors:",
    "Translate to French: The weather is lovely today, and I would like to go for a long walk "
    "in the park with my dog before it starts to rain.",
    "Question: What is 12 plus 30?\nAnswer:",
]


@pytest.fixture(scope="session")
def smol_gguf() -> Path:
    return bundled_model_path()


@pytest.fixture(scope="session")
def smol_hf_dir(tmp_path_factory: pytest.TempPathFactory, smol_gguf: Path) -> Path:
    """The bundled GGUF loaded by transformers and saved once as safetensors (fast reloads)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("smollm2-hf")
    tokenizer = AutoTokenizer.from_pretrained(smol_gguf.parent, gguf_file=smol_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(smol_gguf.parent, gguf_file=smol_gguf.name,
                                                 dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model while its quantizer is attached.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def smol_hf_model(smol_hf_dir: Path):  # noqa: ANN201 - a transformers model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smol_hf_dir: Path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), smol_hf_dir, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, smol_hf_dir: Path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), smol_hf_dir, "qwen2")


@pytest.fixture(scope="session")
def smol_prompt_ids(smol_gguf: Path) -> list[list[int]]:
    from pkv.core.model_loader.loader import open_model

    tokenizer = open_model(str(smol_gguf)).tokenizer
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="session")
def smol_llm(smol_gguf: Path):  # noqa: ANN201 - pkv.LLM
    """The bundled model through pkv's own GGUF loader, shared by behaviour tests (guided
    decoding by outlines: its tests reach into that backend)."""
    from pkv import LLM

    return LLM(kv_cache_memory="128MiB", max_model_len=512, show_progress=False,
               guided_decoding_backend="outlines")


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face hub cache, offline; huggingface_hub's import-time constants
    are bypassed."""
    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache
