"""Where pushes go: one small interface, two implementations.

* :class:`FilesystemTarget`: a path, a ``file://`` URL or any fsspec URL (``s3://`` with s3fs,
  ``gs://`` with gcsfs, ``memory://``, ...).
* :class:`HubTarget`: a Hugging Face Hub model repo (``user/model``) through ``huggingface_hub``.

A third party adds another by subclassing :class:`Target`; :func:`open_target` picks one from
``hub.repo``.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Sequence

from engine import ConfigError
from engine.kit.layout import FINAL_MARKER, MARKER, TMP  # no torch in the upload process

# manifests are written last and removed first, so a remote folder with one is complete
_MARKERS = (MARKER, FINAL_MARKER)


class RemoteMissing(Exception):
    """The remote folder asked for is not there."""


class Target:
    """A place to push folders to and fetch them back from."""

    #: what logs and errors show (never a credential)
    description: str

    def check(self) -> None:
        """Before training: make sure the target exists and can be written (create it); ConfigError if not."""
        raise NotImplementedError

    def upload(self, folder: Path, path_in_repo: str, message: str, ignore: Sequence[str] = (),
               replace: bool = False) -> None:
        """Put ``folder``'s files (except those matching ``ignore``) under ``path_in_repo`` ("" is the root).

        ``replace``: afterwards the remote folder holds exactly these files (stale ones removed).
        """
        raise NotImplementedError

    def download(self, path_in_repo: str, local: Path) -> None:
        """Fetch the remote folder ``path_in_repo`` into ``local``; RemoteMissing when it is not there."""
        raise NotImplementedError


def local_files(folder: Path, ignore: Sequence[str]) -> list[str]:
    """Relative POSIX paths of ``folder``'s files not matching ``ignore``, manifests last."""
    names = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    names = [n for n in names if not any(fnmatch.fnmatch(n, pattern) for pattern in ignore)]
    return sorted(names, key=lambda name: (name in _MARKERS, name))


class FilesystemTarget(Target):
    """A folder on any fsspec filesystem; files are copied one by one, manifests last."""

    def __init__(self, url: str):
        import fsspec

        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(os.path.expanduser(url))
        except (ValueError, ImportError) as exc:  # an unknown protocol, or its package is missing
            raise ConfigError(f"hub.repo: cannot open {url!r} with fsspec: {exc}") from None
        self.root = self.root.rstrip("/")
        self.description = url

    def _remote(self, path_in_repo: str) -> str:
        return f"{self.root}/{path_in_repo}".rstrip("/") if path_in_repo else self.root

    def check(self) -> None:
        probe = f"{self.root}/.engine-write-check"
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"")
            self.fs.rm_file(probe)
        except (OSError, PermissionError) as exc:
            raise ConfigError(f"hub.repo: cannot write to {self.url}: {exc.strerror or exc}") from None

    def upload(self, folder: Path, path_in_repo: str, message: str, ignore: Sequence[str] = (),
               replace: bool = False) -> None:
        remote = self._remote(path_in_repo)
        names = local_files(folder, ignore)
        existing = self._files(remote) if replace else []
        for marker in _MARKERS:  # the old manifest goes first: a half-replaced folder is never "complete"
            if marker in existing:
                self.fs.rm_file(f"{remote}/{marker}")
        made = set()
        for name in names:
            if name in _MARKERS:
                for stale in set(existing) - set(names):  # before the manifest makes the folder complete
                    self.fs.rm_file(f"{remote}/{stale}")
                existing = []
            parent = f"{remote}/{name}".rsplit("/", 1)[0]
            if parent not in made:
                self.fs.makedirs(parent, exist_ok=True)
                made.add(parent)
            # into place by a rename: a reader never sees half a file (on object stores, a copy)
            partial = f"{parent}/{TMP}{name.rsplit('/', 1)[-1]}"
            self.fs.put_file(str(folder / name), partial)
            self.fs.mv(partial, f"{remote}/{name}")
        for stale in set(existing) - set(names):
            self.fs.rm_file(f"{remote}/{stale}")

    def _files(self, remote: str) -> list[str]:
        if not self.fs.isdir(remote):
            return []
        prefix = self.fs._strip_protocol(remote).rstrip("/") + "/"
        return [path[len(prefix):] for path in self.fs.find(remote) if path.startswith(prefix)]

    def download(self, path_in_repo: str, local: Path) -> None:
        remote = self._remote(path_in_repo)
        names = self._files(remote)
        if not names:
            raise RemoteMissing(f"{self.url} has no {path_in_repo}/")
        for name in names:
            (local / name).parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(f"{remote}/{name}", str(local / name))


_REPO_ID = re.compile(r"(?:[A-Za-z0-9][\w.\-]*/)?[A-Za-z0-9][\w.\-]*")


def is_repo_id(repo: str) -> bool:
    """``user/model``, or a bare ``model`` that the Hub creates under the token owner's namespace as Trainer's
    ``hub_model_id`` does (what the Hub accepts: letters, digits, ``-_.``; no ``--`` or ``..``, no ``.git`` end)."""
    return bool(_REPO_ID.fullmatch(repo)) and "--" not in repo and ".." not in repo \
        and not repo.endswith(".git") and len(repo.split("/")[-1]) <= 96


class HubTarget(Target):
    """A model repo on the Hugging Face Hub (or the server ``HF_ENDPOINT`` names)."""

    def __init__(self, repo_id: str, token: str | None, private: bool, revision: str | None,
                 connect_timeout: float):
        self.repo_id, self.token, self.private, self.revision = repo_id, token, private, revision
        self.connect_timeout = connect_timeout

    @property
    def description(self) -> str:
        return f"the Hub repo {self.repo_id}" + (f" (branch {self.revision})" if self.revision else "")

    def check(self) -> None:
        import huggingface_hub
        from huggingface_hub import constants

        from engine.tracking import wait_for_server

        try:
            # huggingface_hub's API calls have no timeout: a Hub that never answers would hold the start forever
            wait_for_server(constants.ENDPOINT, self.connect_timeout, "hub")
            created = huggingface_hub.create_repo(self.repo_id, token=self.token, private=self.private, exist_ok=True)
            if created.repo_id != self.repo_id:  # a bare name: the Hub put it under the token owner's namespace
                logging.getLogger("engine.hub").info("hub.repo %r is %s", self.repo_id, created.repo_id)
                self.repo_id = created.repo_id
            if self.revision:
                huggingface_hub.create_branch(self.repo_id, branch=self.revision, token=self.token, exist_ok=True)
        except Exception as exc:  # HTTP errors, no connection, refused credentials
            raise ConfigError(f"hub.repo: cannot create or reach {self.description}: {describe(exc)}") from None

    def upload(self, folder: Path, path_in_repo: str, message: str, ignore: Sequence[str] = (),
               replace: bool = False) -> None:
        import huggingface_hub

        huggingface_hub.upload_folder(
            repo_id=self.repo_id, folder_path=str(folder), path_in_repo=path_in_repo or None,
            commit_message=message, token=self.token, revision=self.revision,
            ignore_patterns=list(ignore) or None,
            # delete_patterns are matched inside path_in_repo: files this push re-adds are kept
            delete_patterns=["*"] if replace else None)

    def download(self, path_in_repo: str, local: Path) -> None:
        import huggingface_hub

        files = huggingface_hub.list_repo_files(self.repo_id, revision=self.revision, token=self.token)
        if not any(name.startswith(path_in_repo + "/") for name in files):
            raise RemoteMissing(f"{self.description} has no {path_in_repo}/")
        fetched = local.with_name(local.name + "-snapshot")
        shutil.rmtree(fetched, ignore_errors=True)
        huggingface_hub.snapshot_download(self.repo_id, revision=self.revision, token=self.token,
                                          allow_patterns=[f"{path_in_repo}/*"], local_dir=str(fetched))
        os.replace(fetched / path_in_repo, local)
        shutil.rmtree(fetched)


def describe(exc: BaseException) -> str:
    """The exception's type and the first line of its message (HTTP errors add lines of advice)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def is_filesystem(repo: str) -> bool:
    """A URL, an absolute or relative path, or a home path: not a Hub repo id."""
    return "://" in repo or repo.startswith(("/", "./", "../", "~")) or repo in (".", "..")


def open_target(repo: str, token: str | None, private: bool, revision: str | None,
                connect_timeout: float) -> Target:
    if is_filesystem(repo):
        return FilesystemTarget(repo)
    return HubTarget(repo, token, private, revision, connect_timeout)
