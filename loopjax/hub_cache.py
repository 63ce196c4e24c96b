"""Hugging Face Hub names ('org/name') -> the snapshot folder already in the local Hub cache
(what `huggingface-cli download`, transformers or vLLM left there), so `loopjax.load`,
`loopjax convert` and the command lines take a Hub name as vLLM does. Nothing is downloaded:
the machines loopjax runs on may have no network. Pure Python, no huggingface_hub needed.

The cache is `$HF_HUB_CACHE` (or the older `$HUGGINGFACE_HUB_CACHE`), else `$HF_HOME/hub`, else
`$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`; a repo's
folder is `models--ORG--NAME`, its `refs/main` names the commit whose `snapshots/COMMIT`
holds the files (a cache whose refs/main is missing, empty or names a snapshot not there serves
its only snapshot; with several, the error says so).
"""

from __future__ import annotations

import os
import re

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def cache_dir() -> str:
    """As huggingface_hub finds it: '~' and $VARS expanded in each variable."""
    expand = lambda path: os.path.expandvars(os.path.expanduser(path))
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(cache, "huggingface")
    hub = (os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
           or os.path.join(expand(home), "hub"))
    return expand(hub)


def is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.fullmatch(name)) and ".." not in name


def snapshot(repo_id: str) -> str | None:
    """The cached snapshot folder of `repo_id`'s main revision, or None: the one `refs/main`
    names, else (no refs/main, an empty one, or one naming a snapshot not there) the only
    snapshot; with several, which one is main is unknown."""
    if not is_repo_id(repo_id):
        return None
    snapshots = os.path.join(_repo_folder(repo_id), "snapshots")
    commit = _main_commit(repo_id)
    if commit and os.path.isdir(os.path.join(snapshots, commit)):
        return os.path.join(snapshots, commit)
    found = _snapshot_names(repo_id)
    return os.path.join(snapshots, found[0]) if len(found) == 1 else None


def _repo_folder(repo_id: str) -> str:
    return os.path.join(cache_dir(), "models--" + repo_id.replace("/", "--"))


def _main_commit(repo_id: str) -> str:
    """What `refs/main` names ('' where it is missing or unreadable)."""
    try:
        with open(os.path.join(_repo_folder(repo_id), "refs", "main")) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _snapshot_names(repo_id: str) -> list[str]:
    snapshots = os.path.join(_repo_folder(repo_id), "snapshots")
    try:
        return sorted(name for name in os.listdir(snapshots) if os.path.isdir(os.path.join(snapshots, name)))
    except OSError:
        return []


def resolve(name: str) -> str:
    """`name` itself where it exists (or names no cached repo), else its cached snapshot."""
    if os.path.exists(name):
        return name
    return snapshot(name) or name


class BrokenLinkError(ValueError):
    """A file that is a symbolic link to nothing; the message is one line naming it."""


def is_file(path: str) -> bool:
    """`os.path.isfile`, except that a symbolic link whose target is missing raises a one-line
    `BrokenLinkError` rather than reading as no file: a snapshot folder copied without the
    cache's blobs (its files are links to ../../blobs/HASH) must not look like a folder without
    weights or without a tokenizer."""
    if os.path.islink(path) and not os.path.exists(path):
        raise BrokenLinkError(f"{path} is a broken link: its target {os.readlink(path)} is missing")
    return os.path.isfile(path)


def missing_hint(name: str) -> str:
    """For a Hub name not in the cache (or whose main snapshot is unknown): the words telling
    how to get it ('' otherwise)."""
    if not is_repo_id(name) or os.path.exists(name):
        return ""
    found = _snapshot_names(name)
    if len(found) > 1:
        main = _main_commit(name)
        refs = f"its refs/main names {main!r}, not one of them" if main else "it has no refs/main"
        return (f", and the Hugging Face cache at {cache_dir()} holds {len(found)} snapshots of it "
                f"but {refs} (pass the snapshot folder itself)")
    return (f", nor in the Hugging Face cache at {cache_dir()} (download it first: "
            f"huggingface-cli download {name})")
