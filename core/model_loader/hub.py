"""Hugging Face model ids ("Qwen/Qwen3-0.6B") to a local snapshot folder, or a .gguf in it.

Contract of `resolve_model`:
  - a string that names an existing path, or is not shaped like `ORG/NAME`, comes back as
    a Path untouched (the caller reports a missing path);
  - an id is looked up in the Hugging Face cache first (HF_HUB_CACHE, HF_HOME, read at
    call time), then downloaded with huggingface_hub's progress bars unless
    HF_HUB_OFFLINE=1;
  - only safetensors (the index's shards when there is one), one named .gguf, config and
    tokenizer files are fetched: never pickles (*.bin, *.pt, *.pth);
  - a snapshot is used only when its config and every weight file are there, so an
    interrupted download (huggingface_hub renames each finished blob into place) reads as
    "missing", never as a model;
  - every failure is one line (ValueError / FileNotFoundError) that names the id.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

# `org/name` as the Hub spells it; a leading "./", "/" or "~" makes it a path instead.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")
# sentence-transformers' description of an embedding model: its modules and their configs
# (1_Pooling/config.json decides mean or CLS pooling)
SENTENCE_FILES = re.compile(r"(modules\.json|sentence_bert_config\.json|"
                            r"config_sentence_transformers\.json|\d+_\w+/[^/]+\.json)")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_TRUE = ("1", "ON", "YES", "TRUE")


def is_hub_id(model: str) -> bool:
    """True for `ORG/NAME` that is not a path on this machine (nor a file name typo)."""
    return (_REPO_ID.fullmatch(model) is not None and "--" not in model and ".." not in model
            and not model.endswith((".gguf", ".safetensors", ".json"))
            and not Path(model).expanduser().exists())


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub would use, from the environment as it is now (its own
    constants are read once at import)."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
        cache = os.path.join(home, "hub")
    return Path(os.path.expandvars(cache)).expanduser()


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now, or as huggingface_hub read it."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.upper() in _TRUE or constants.HF_HUB_OFFLINE


def resolve_model(model: str, revision: str | None = None,
                  gguf_file: str | None = None) -> Path:
    """A local path for `model`: itself when it is a path, else its Hub snapshot (the
    folder, or `gguf_file` inside it)."""
    if gguf_file is not None:
        parts = Path(gguf_file).parts
        if not gguf_file.endswith(".gguf") or Path(gguf_file).is_absolute() or ".." in parts:
            raise ValueError(f"gguf_file must be the name of a .gguf file inside the model "
                             f"repo or folder, got {gguf_file!r}")
    if not is_hub_id(model):
        path = Path(model).expanduser()
        if not path.exists():
            return path  # the caller names the missing path
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hugging Face ids, and "
                             f"{model!r} is a local path")
        if gguf_file is not None:
            if not path.is_dir():
                raise ValueError(f"gguf_file={gguf_file!r} needs a Hugging Face id or a "
                                 f"folder, and {model!r} is a file")
            return path / gguf_file
        return path
    cache_dir, offline = hub_cache_dir(), hub_offline()
    folder = _cached_snapshot(model, revision, gguf_file, cache_dir)
    if folder is not None:
        try:
            found = _complete(folder, model, gguf_file, revision)
        except ValueError:
            if offline:
                raise
            found = None  # e.g. a cached pickle: the Hub's own listing decides below
        if found is not None:
            return found
    if offline:
        what = ("is only partly in" if folder is not None
                else "is neither a local path nor in")
        raise FileNotFoundError(
            f"{model}{_at(revision)} {what} the Hugging Face cache ({cache_dir}) and "
            f"HF_HUB_OFFLINE=1: fetch it with `{fetch_command(model, revision, gguf_file)}`, "
            "or run once with network")
    folder = _download(model, revision, gguf_file, cache_dir)
    found = _complete(folder, model, gguf_file, revision)
    if found is None:
        raise FileNotFoundError(f"the download of {model}{_at(revision)} into {folder} is "
                                "incomplete (config.json or weights missing): run again")
    return found


def on_this_machine(model: str, revision: str | None = None,
                    gguf_file: str | None = None) -> bool:
    """Whether `model` opens here without the network: a path that exists, or a Hub id
    whose snapshot is whole in the cache."""
    if not is_hub_id(model):
        return Path(model).expanduser().exists()
    folder = _cached_snapshot(model, revision, gguf_file, hub_cache_dir())
    try:
        return folder is not None and _complete(folder, model, gguf_file, revision) is not None
    except ValueError:
        return False  # the Hub's own listing decides when serving


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def resolve_adapter(path: str) -> Path:
    """A LoRA adapter's folder: `path` itself when it is one here (or not shaped like an
    id), else the Hub snapshot of that id, cache first; only the adapter's config and
    safetensors are ever fetched. Failures are one line naming the id."""
    if not is_hub_id(path):  # which includes every path that exists here
        return Path(path).expanduser()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache_dir = hub_cache_dir()
    try:
        folder = Path(snapshot_download(path, cache_dir=cache_dir, local_files_only=True,
                                        allow_patterns=list(ADAPTER_FILES)))
        if all((folder / f).is_file() for f in ADAPTER_FILES):
            return folder
    except LocalEntryNotFoundError:  # also IncompleteSnapshotError
        pass
    if hub_offline():
        raise FileNotFoundError(f"{path} is neither a local folder nor in the Hugging Face "
                                f"cache ({cache_dir}) and HF_HUB_OFFLINE=1: fetch it with "
                                f"`hf download {path} {' '.join(ADAPTER_FILES)}`")
    logger.info("downloading LoRA adapter %s from the Hugging Face Hub into %s", path,
                cache_dir)
    try:
        return Path(snapshot_download(path, cache_dir=cache_dir,
                                      allow_patterns=list(ADAPTER_FILES)))
    except Exception as exc:  # huggingface_hub's many network and repo errors
        raise FileNotFoundError(f"cannot fetch {path} from the Hugging Face Hub "
                                f"({type(exc).__name__})") from None


def fetch_command(repo_id: str, revision: str | None = None,
                  gguf_file: str | None = None) -> str:
    """The `hf download` line that fetches what pkv reads from `repo_id`."""
    rev = f" --revision {revision}" if revision else ""
    if gguf_file:
        return f"hf download {repo_id} {gguf_file}{rev}"
    return (f"hf download {repo_id}{rev} --include '*.safetensors' --include '*.json' "
            "--include '*.jinja' --include '*.model' --include '*.txt'")


def _at(revision: str | None) -> str:
    return f" (revision {revision})" if revision else ""


def _cached_snapshot(repo_id: str, revision: str | None, gguf_file: str | None,
                     cache_dir: Path) -> Path | None:
    """The cached snapshot folder of `revision` (refs/<branch> or a commit), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        # Only resolves refs/ and snapshots/ (no network); the pattern is the one file
        # every usable snapshot has, so huggingface_hub's own completeness check (from its
        # cached file listing, when there is one) does not ask for files pkv never reads.
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                      local_files_only=True,
                                      allow_patterns=[gguf_file or "config.json"]))
    except LocalEntryNotFoundError:  # also IncompleteSnapshotError
        return None


def _complete(folder: Path, repo_id: str, gguf_file: str | None,
              revision: str | None) -> Path | None:
    """The path to load from a snapshot, or None while files are missing. Raises for a
    snapshot that can never be loaded (pickles only, GGUF without a choice)."""
    if gguf_file is not None:
        return folder / gguf_file if (folder / gguf_file).is_file() else None
    entries = list(folder.iterdir())
    if any(p.is_symlink() and not p.exists() for p in entries):
        return None  # a blob went missing: fetch again rather than load part of a model
    names = sorted(p.name for p in entries if p.is_file())
    _pick_weights(repo_id, names, revision)  # raises for pickles / GGUF-only
    if "config.json" not in names:
        return None
    indexes = _indexes(names)
    if indexes:
        shards = _index_shards(folder / indexes[0])
        return folder if all((folder / s).is_file() for s in shards) else None
    return folder if any(n.endswith(".safetensors") for n in names) else None


def _pick_weights(repo_id: str, files: list[str], revision: str | None) -> list[str]:
    """The top-level safetensors files of a repo listing; one line for repos pkv cannot
    load without a choice (GGUF only) or never loads (pickles only)."""
    top = [f for f in files if "/" not in f]
    weights = [f for f in top if f.endswith(".safetensors")]
    # Mistral repos ship consolidated.safetensors beside the HF shards: the same weights.
    if any(not w.startswith("consolidated") for w in weights):
        weights = [w for w in weights if not w.startswith("consolidated")]
    if weights:
        return weights
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if ggufs:
        shown = ", ".join(ggufs[:8]) + (f", ... ({len(ggufs) - 8} more)" if len(ggufs) > 8 else "")
        raise ValueError(f"{repo_id}{_at(revision)} holds GGUF files only: pick one with "
                         f"--gguf-file / gguf_file= ({shown})")
    pickles = [f for f in top if f.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise ValueError(f"{repo_id}{_at(revision)} has only pickle weights "
                         f"({', '.join(pickles)}), which pkv never loads (they can run code): "
                         "use a safetensors or GGUF repo, or convert them")
    return []


def _indexes(files: list[str]) -> list[str]:
    """The safetensors indexes at the top of a listing, the Hugging Face one first (Mistral
    repos also index their consolidated.safetensors shards, in Mistral's own names)."""
    top = [f for f in files if "/" not in f and f.endswith(".safetensors.index.json")]
    return sorted(top, key=lambda f: (f.startswith("consolidated"), f))


def _index_shards(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{index} is not a valid safetensors index (no weight_map)") from None


def _download(repo_id: str, revision: str | None, gguf_file: str | None,
              cache_dir: Path) -> Path:
    """Fetch the files pkv reads into the hub cache (huggingface_hub writes each to
    `<blob>.incomplete` and renames it when whole) and return the snapshot folder."""
    import httpx2
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError,
                                        LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    def fetch(patterns: list[str]) -> Path:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                      allow_patterns=patterns))

    try:
        info = HfApi().model_info(repo_id, revision=revision)
        files = [s.rfilename for s in info.siblings or []]
        if gguf_file is not None:
            if gguf_file not in files:
                ggufs = ", ".join(sorted(f for f in files if f.endswith(".gguf"))) or "none"
                raise FileNotFoundError(f"{repo_id}{_at(revision)} has no {gguf_file} "
                                        f"(its .gguf files: {ggufs})")
            patterns = [gguf_file]
        else:
            weights = _pick_weights(repo_id, files, revision)
            if not weights:
                raise ValueError(f"{repo_id}{_at(revision)} has no *.safetensors or *.gguf "
                                 "weights pkv can load")
            indexes = _indexes(files)
            if indexes:  # exactly the shards it names
                index = hf_hub_download(repo_id, indexes[0], revision=revision,
                                        cache_dir=cache_dir)
                weights = [indexes[0], *_index_shards(Path(index))]
            patterns = (weights + [f for f in CONFIG_FILES + TOKENIZER_FILES if f in files]
                        + [f for f in files if SENTENCE_FILES.fullmatch(f)])
        logger.info("downloading %s%s from the Hugging Face Hub into %s", repo_id,
                    _at(revision), cache_dir)
        return fetch(patterns)
    except GatedRepoError:
        raise ValueError(f"{repo_id} is a gated repo: accept its license on "
                         f"https://huggingface.co/{repo_id} and set HF_TOKEN to a token of "
                         "that account") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{repo_id!r} is neither a local path nor a Hugging Face "
                                "model repo (check the spelling; a private repo needs "
                                "HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{repo_id} has no revision {revision!r}") from None
    except (OfflineModeIsEnabled, LocalEntryNotFoundError, httpx2.TransportError) as exc:
        raise FileNotFoundError(
            f"{repo_id}{_at(revision)} is neither a local path nor in the Hugging Face cache "
            f"({cache_dir}), and the Hub cannot be reached ({type(exc).__name__}): fetch it with "
            f"`{fetch_command(repo_id, revision, gguf_file)}` where there is network") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise FileNotFoundError(f"the Hugging Face Hub answered HTTP {status} for "
                                f"{repo_id}{_at(revision)}") from None
