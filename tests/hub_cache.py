"""A Hugging Face hub cache built on disk, laid out as huggingface_hub writes it, so models
by hub id are tested offline: models--OWNER--NAME/{blobs/SHA, snapshots/COMMIT/FILE ->
../../blobs/SHA, refs/REVISION (the commit)}."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_snapshot(
    hub: Path, repo_id: str, files: dict[str, Path], revision: str = "main", link: bool = False
) -> str:
    """Put `files` (name in the repo -> local file) into the cache as one commit that
    `revision` names; returns the commit hash. `link`: blobs are links to the local files
    (a big GGUF is not copied)."""
    owner, name = repo_id.split("/")
    repo = hub / f"models--{owner}--{name}"
    digest = hashlib.sha1()
    for rel, src in sorted(files.items()):
        digest.update(f"{rel}:{src.stat().st_size}:{src}".encode())
    commit = digest.hexdigest()  # 40 hex digits, as a git commit
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for rel, src in files.items():
        blob = repo / "blobs" / hashlib.sha256(f"{commit}/{rel}".encode()).hexdigest()
        if not blob.exists():
            if link:
                blob.symlink_to(src.resolve())
            else:
                blob.write_bytes(src.read_bytes())
        target = snapshot / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(os.path.relpath(blob, target.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit


def add_checkpoint_dir(hub: Path, repo_id: str, path: Path, revision: str = "main") -> str:
    """Every file of a checkpoint dir as one commit of `repo_id`."""
    files = {p.name: p for p in sorted(path.iterdir()) if p.is_file()}
    return add_snapshot(hub, repo_id, files, revision)
