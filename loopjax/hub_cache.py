"""Hugging Face Hub names ('org/name') -> the snapshot folder already in the local Hub cache
(what `huggingface-cli download`, transformers or vLLM left there), so `loopjax.load`,
`loopjax convert` and the command lines take a Hub name as vLLM does. Nothing is downloaded:
the machines loopjax runs on may have no network. Pure Python, no huggingface_hub needed.

The cache is `$HF_HUB_CACHE` (or the older `$HUGGINGFACE_HUB_CACHE`), else `$HF_HOME/hub`, else
`$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`; a repo's
folder is `models--ORG--NAME`, its `refs/main` names the commit whose `snapshots/COMMIT`
holds the files (a cache without refs and with one snapshot serves that one).
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
    """The cached snapshot folder of `repo_id`'s main revision, or None."""
    if not is_repo_id(repo_id):
        return None
    repo = os.path.join(cache_dir(), "models--" + repo_id.replace("/", "--"))
    snapshots = os.path.join(repo, "snapshots")
    try:
        with open(os.path.join(repo, "refs", "main")) as f:
            commit = f.read().strip()
    except OSError:
        found = sorted(os.listdir(snapshots)) if os.path.isdir(snapshots) else []
        commit = found[0] if len(found) == 1 else ""
    folder = os.path.join(snapshots, commit)
    return folder if commit and os.path.isdir(folder) else None


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
    """For a Hub name not in the cache: the words telling how to get it ('' otherwise)."""
    if not is_repo_id(name) or os.path.exists(name):
        return ""
    return (f", nor in the Hugging Face cache at {cache_dir()} (download it first: "
            f"huggingface-cli download {name})")
