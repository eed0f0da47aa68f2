"""Hugging Face model ids, offline: a hub cache laid out by hand (blobs, snapshots, refs),
cached snapshots found, `revision`/`gguf_file` picks, and one-line errors for the rest."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from pkv import LLM, SamplingParams
from pkv.cli.main import app
from pkv.core.model_loader import hub
from pkv.core.model_loader.hub import resolve_model
from pkv.tests.helpers import build_tiny_model, write_gguf

REV_A, REV_B = "a" * 40, "b" * 40
PROMPTS = [[100 + i for i in range(n)] for n in (3, 17)]


def add_snapshot(cache: Path, repo_id: str, rev: str, files: dict[str, Path | bytes],
                 ref: str | None = "main") -> Path:
    """`models--org--name/{blobs,snapshots/<rev>,refs/<ref>}` as huggingface_hub writes it:
    each snapshot file a relative symlink to its content-addressed blob."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, content in files.items():
        data = content if isinstance(content, bytes) else content.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("../../blobs") / blob.name)
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(rev)
    return snapshot


def folder_files(folder: Path) -> dict[str, Path | bytes]:
    return {p.name: p for p in folder.iterdir() if p.is_file()}


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def folder_greedy(tiny_llama_dir: Path) -> list[list[int]]:
    return greedy(LLM(str(tiny_llama_dir), kv_cache_memory="8MiB", show_progress=False))


def test_cached_snapshot_is_found_offline_and_generates(hub_cache: Path, tiny_llama_dir: Path,
                                                        folder_greedy: list[list[int]]):
    snapshot = add_snapshot(hub_cache, "org/tiny", REV_A, folder_files(tiny_llama_dir))
    assert resolve_model("org/tiny") == snapshot
    llm = LLM("org/tiny", kv_cache_memory="8MiB", show_progress=False)
    assert llm.llm_engine.model_name == "org/tiny"  # not the commit hash
    assert greedy(llm) == folder_greedy


def test_revision_picks_another_snapshot(hub_cache: Path, tmp_path: Path, tiny_llama_dir: Path,
                                         smol_hf_dir: Path):
    add_snapshot(hub_cache, "org/tiny", REV_A, folder_files(tiny_llama_dir))
    one_layer = build_tiny_model(tmp_path / "one-layer", smol_hf_dir, num_hidden_layers=1)
    second = add_snapshot(hub_cache, "org/tiny", REV_B, folder_files(one_layer), ref="v2")
    assert resolve_model("org/tiny", revision="v2") == second
    assert resolve_model("org/tiny", revision=REV_B) == second
    llm = LLM("org/tiny", revision="v2", kv_cache_memory="8MiB", show_progress=False)
    assert llm.llm_engine.model_config.num_hidden_layers == 1
    with pytest.raises(FileNotFoundError, match="revision v3"):
        resolve_model("org/tiny", revision="v3")


def test_offline_miss_is_one_line_naming_the_id(hub_cache: Path):
    with pytest.raises(FileNotFoundError) as err:
        resolve_model("org/missing")
    message = str(err.value)
    assert "\n" not in message and "org/missing" in message and "HF_HUB_OFFLINE=1" in message
    assert "hf download org/missing" in message and str(hub_cache) in message
    assert "neither a local path" in message  # (a mistyped local path reads as an id too)


def test_pickle_only_repo_is_refused(hub_cache: Path, tiny_llama_dir: Path):
    add_snapshot(hub_cache, "org/pickled", REV_A, {
        "config.json": tiny_llama_dir / "config.json", "pytorch_model.bin": b"\x80\x04pickle"})
    with pytest.raises(ValueError, match=r"only pickle weights \(pytorch_model.bin\).*never"):
        LLM("org/pickled", kv_cache_memory="8MiB", show_progress=False)


def test_half_downloaded_snapshot_is_not_used(hub_cache: Path, tiny_llama_dir: Path):
    """An index naming two shards, one still `.incomplete` among the blobs: reported, never
    loaded as a model."""
    files = folder_files(tiny_llama_dir)
    weights = files.pop("model.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    files |= {"model.safetensors.index.json": json.dumps(index).encode(),
              "model-00001-of-00002.safetensors": weights}
    snapshot = add_snapshot(hub_cache, "org/partial", REV_A, files)
    (snapshot.parents[1] / "blobs" / "0123.incomplete").write_bytes(b"\0" * 10)
    with pytest.raises(FileNotFoundError, match="org/partial is only partly in the Hugging"):
        resolve_model("org/partial")
    # a blob that vanished (cache cleaned) leaves a dangling link: also incomplete
    (snapshot / "model-00002-of-00002.safetensors").symlink_to("../../blobs/gone")
    with pytest.raises(FileNotFoundError, match="only partly in"):
        resolve_model("org/partial")


def test_gguf_file_picks_one_gguf(hub_cache: Path, tmp_path: Path, tiny_llama_dir: Path,
                                  smol_gguf: Path, folder_greedy: list[list[int]]):
    f32 = write_gguf(tiny_llama_dir, tmp_path / "tiny-F32.gguf", "F32", smol_gguf)
    snapshot = add_snapshot(hub_cache, "org/tiny-GGUF", REV_A, {
        "tiny-F32.gguf": f32, "tiny-Q8_0.gguf": b"GGUF not read"})
    with pytest.raises(ValueError, match=r"GGUF files only.*tiny-F32.gguf, tiny-Q8_0.gguf"):
        resolve_model("org/tiny-GGUF")
    assert resolve_model("org/tiny-GGUF", gguf_file="tiny-F32.gguf") == snapshot / "tiny-F32.gguf"
    llm = LLM("org/tiny-GGUF", gguf_file="tiny-F32.gguf", kv_cache_memory="8MiB",
              show_progress=False)
    assert llm.llm_engine.model_name == "org/tiny-GGUF"
    assert greedy(llm) == folder_greedy
    with pytest.raises(FileNotFoundError, match="hf download org/tiny-GGUF tiny-Q4_0.gguf"):
        resolve_model("org/tiny-GGUF", gguf_file="tiny-Q4_0.gguf")
    with pytest.raises(ValueError, match="gguf_file must be the name of a .gguf"):
        resolve_model("org/tiny-GGUF", gguf_file="../x.gguf")


def test_local_paths_are_not_hub_ids(hub_cache: Path, tiny_llama_dir: Path):
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir
    for path in ("./org/name", "/org/name", "~/org/name", "models/tiny.gguf", "name", "a/b/c"):
        assert not hub.is_hub_id(path)
        assert resolve_model(path) == Path(path).expanduser()  # the caller names it missing
    with pytest.raises(ValueError, match="revision='main' applies to Hugging Face ids"):
        resolve_model(str(tiny_llama_dir), revision="main")


def test_download_fetches_only_safetensors_config_and_tokenizer(
        hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The online path with the Hub replaced: the allow-list holds the index's shards, the
    config, tokenizer and sentence-transformers files (its pooling), never pickles or
    Mistral's consolidated copy (nor its index, which sorts first)."""
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    listing = ["consolidated.safetensors.index.json",  # (the Hub lists names sorted)
               "config.json", "generation_config.json", "tokenizer.json", "README.md",
               "model.safetensors.index.json", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "consolidated.safetensors",
               "pytorch_model.bin", "original/consolidated.00.pth", "modules.json",
               "1_Pooling/config.json", "config_sentence_transformers.json"]
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"weight_map": {"x": "model-00001-of-00002.safetensors",
                                                "y": "model-00002-of-00002.safetensors"}}))
    asked: list[list[str]] = []
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo_id, revision=None:
                        SimpleNamespace(siblings=[SimpleNamespace(rfilename=f) for f in listing]))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: str(index))
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, **k: asked.append(k["allow_patterns"]) or str(tmp_path))
    with pytest.raises(FileNotFoundError, match="download of org/big into .* is incomplete"):
        resolve_model("org/big")  # the stub fetched nothing
    assert asked[-1] == ["model.safetensors.index.json", "model-00001-of-00002.safetensors",
                         "model-00002-of-00002.safetensors", "config.json",
                         "generation_config.json", "tokenizer.json", "modules.json",
                         "1_Pooling/config.json", "config_sentence_transformers.json"]
    listing[:] = ["config.json", "pytorch_model.bin", "model.pt"]
    with pytest.raises(ValueError, match=r"only pickle weights \(pytorch_model.bin, model.pt\)"):
        resolve_model("org/old")


def test_gated_and_missing_repos_are_one_line(hub_cache: Path, monkeypatch: pytest.MonkeyPatch):
    import httpx2
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    response = httpx2.Response(403, request=httpx2.Request("GET", "https://huggingface.co"))
    for error, expected in ((GatedRepoError, "org/x is a gated repo: accept its license"),
                            (RepositoryNotFoundError, "neither a local path nor a Hugging Face")):
        def fail(self, repo_id, revision=None, error=error):
            raise error("multi\nline hub text", response=response)

        monkeypatch.setattr(huggingface_hub.HfApi, "model_info", fail)
        with pytest.raises((ValueError, FileNotFoundError)) as err:
            resolve_model("org/x")
        assert expected in str(err.value) and "\n" not in str(err.value)


def test_check_reads_a_cached_hub_model(hub_cache: Path, tiny_llama_dir: Path):
    add_snapshot(hub_cache, "org/cached", REV_A, folder_files(tiny_llama_dir))
    ok = CliRunner().invoke(app, ["serve", "org/cached", "--check"])
    assert ok.exit_code == 0 and "org/cached (llama, read without weights)" in ok.output
    too_long = CliRunner().invoke(app, ["serve", "org/cached", "--check",
                                        "--max-model-len", str(10**7)])
    assert too_long.exit_code == 2 and "max_position_embeddings" in too_long.stderr


def test_serve_offline_miss_is_one_line_without_traceback(hub_cache: Path):
    result = CliRunner().invoke(app, ["serve", "org/missing", "--port", "0"])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: org/missing is neither a local path")
    assert "hf download org/missing" in lines[0]


def test_layout_helper_matches_huggingface_hub(hub_cache: Path, tiny_llama_dir: Path):
    """The hand-built cache is the one huggingface_hub's own scanner reads."""
    from huggingface_hub import scan_cache_dir

    add_snapshot(hub_cache, "org/tiny", REV_A, folder_files(tiny_llama_dir))
    repos = {r.repo_id: r for r in scan_cache_dir(hub_cache).repos}
    assert {rev.commit_hash for rev in repos["org/tiny"].revisions} == {REV_A}
    assert {rev.refs for rev in repos["org/tiny"].revisions} == {frozenset({"main"})}
