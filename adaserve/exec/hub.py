"""Models by name from the Hugging Face hub: a repo id becomes a local snapshot dir.

`huggingface_hub.snapshot_download` keeps its own cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`)
and answers from it when offline. It reads those variables once, at import; we read them at
every call and pass them on, so a process (or a test) that changes them is honoured. Only the
files adaserve reads are fetched: config, tokenizer and safetensors of a checkpoint repo, or
the one GGUF file asked for. Errors become one line saying what to do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# owner/name as the hub spells repo ids (letters, digits, '-', '_', '.').
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")

# A checkpoint repo: what loader.py reads, at the top level only (no .bin/.pt/.pth, no GGUF,
# no ONNX, no subfolders of other formats: an 8B repo holds 3-4 copies of its weights).
CHECKPOINT_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
TOKENIZER_FILES = [
    "tokenizer*",
    "special_tokens_map.json",
    "config.json",
    "vocab*",
    "merges.txt",
    "*.tiktoken",
    "*.jinja",
]
_TOP_LEVEL_ONLY = ["*/*"]


def looks_like_repo_id(name: str) -> bool:
    """`owner/name`, which is what a hub model id looks like (a local path is checked first)."""
    return _REPO_ID.fullmatch(name) is not None


def hub_cache_dir() -> Path:
    """huggingface_hub's cache as the environment names it now: HF_HUB_CACHE, else
    $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub (~/.cache by default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set to a true value now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def check_repo_id(name: str) -> None:
    """ValueError saying what a model name must be when `name` is no hub id."""
    if not looks_like_repo_id(name):
        raise ValueError(
            f"model {name!r} is not a local path, and not a Hugging Face hub id (owner/name, "
            "e.g. meta-llama/Llama-3.1-8B-Instruct)"
        )


def download_checkpoint(repo_id: str, revision: str | None) -> Path:
    """The snapshot dir of a safetensors checkpoint repo (config, tokenizer, weights)."""
    path = _snapshot(repo_id, revision, CHECKPOINT_FILES, _TOP_LEVEL_ONLY)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"hub repo {repo_id} has no config.json: not a transformers checkpoint; for a repo "
            "of GGUF files name one with gguf_file (--gguf-file NAME.gguf)"
        )
    return path


def download_gguf(repo_id: str, revision: str | None, gguf_file: str) -> Path:
    """One GGUF file of a hub repo, nothing else (it carries its own config and tokenizer)."""
    path = _snapshot(repo_id, revision, [gguf_file], None) / gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"hub repo {repo_id} has no file {gguf_file!r}")
    return path


def download_tokenizer(repo_id: str) -> Path:
    """The tokenizer files of a hub repo (its default branch)."""
    return _snapshot(repo_id, None, TOKENIZER_FILES, _TOP_LEVEL_ONLY)


def _snapshot(
    repo_id: str, revision: str | None, allow: list[str], ignore: list[str] | None
) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (  # (where every version since 0.23 exports them)
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    check_repo_id(repo_id)
    cache, offline = hub_cache_dir(), hub_offline()
    at = f"{repo_id}@{revision}" if revision else repo_id
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=allow,
            ignore_patterns=ignore,
        )
    except GatedRepoError as exc:  # (a RepositoryNotFoundError too: test it first)
        raise ValueError(
            f"hub repo {repo_id} is gated: accept its terms on its hub page, then set HF_TOKEN "
            "to a token of that account"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise FileNotFoundError(
            f"no hub repo {repo_id!r} (or it is private: set HF_TOKEN to a token that may read it)"
        ) from exc
    except RevisionNotFoundError as exc:
        raise FileNotFoundError(f"hub repo {repo_id} has no revision {revision!r}") from exc
    except LocalEntryNotFoundError as exc:  # (an incomplete cached snapshot is one too)
        if offline:
            raise FileNotFoundError(
                f"{at} is not in the hub cache {cache} and HF_HUB_OFFLINE is set: download it "
                "once with HF_HUB_OFFLINE unset, or point HF_HOME at a cache that holds it"
            ) from exc
        raise FileNotFoundError(
            f"could not reach the Hugging Face hub for {at}, and the hub cache {cache} does not "
            f"hold it ({type(exc).__name__}): check the network or HF_ENDPOINT"
        ) from exc
    return Path(path)
