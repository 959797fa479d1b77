"""A local HTTP server speaking the part of the Hugging Face Hub API that ``huggingface_hub`` calls for
``create_repo``, ``create_branch``, ``upload_folder`` (preupload + commit, regular uploads) and
``validate-yaml`` for a README.md, ``list_repo_files`` / ``snapshot_download`` (tree, revision info, resolve): point ``HF_ENDPOINT``
at it. Repos live in memory as {repo id: {branch: {path: bytes}}}; every commit, its branch, its
message and its operations are recorded, and so is the Authorization header of every request.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse


@dataclass
class Commit:
    repo: str
    branch: str
    message: str
    added: list[str]
    deleted: list[str]


@dataclass
class FakeHub:
    repos: dict[str, dict[str, dict[str, bytes]]] = field(default_factory=dict)
    private: dict[str, bool] = field(default_factory=dict)
    commits: list[Commit] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    validated: list[str] = field(default_factory=list)  # model card metadata sent to /api/validate-yaml
    lock: threading.Lock = field(default_factory=threading.Lock)
    user: str = "user"  # the owner of any token: where a bare repo name is created

    def files(self, repo: str, branch: str = "main") -> dict[str, bytes]:
        return self.repos[repo][branch]


def _sha(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _commit_id(files: dict[str, bytes]) -> str:
    return hashlib.sha1(json.dumps(sorted((k, _sha(v)) for k, v in files.items())).encode()).hexdigest()


class Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, body: bytes | dict | list = b"", headers: dict[str, str] | None = None) -> None:
        if not isinstance(body, bytes):
            body = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": message}, {"X-Error-Message": message})

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _record(self) -> None:
        with self.hub.lock:
            self.hub.requests.append(f"{self.command} {self.path}")
            self.hub.authorizations.append(self.headers.get("Authorization"))

    def _branch(self, repo: str, revision: str) -> dict[str, bytes] | None:
        branches = self.hub.repos.get(repo)
        if branches is None:
            return None
        if revision in branches:
            return branches[revision]
        return next((files for files in branches.values() if _commit_id(files) == revision), None)

    # ------------------------------------------------------------------ GET / HEAD

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        self._record()
        url = urlparse(self.path)
        path, query = unquote(url.path), parse_qs(url.query)
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path):
            repo, revision = match.groups()
            files = self._branch(repo, revision)
            if files is None:
                return self._error(404, f"{repo}@{revision} not found")
            return self._send(200, {"id": repo, "modelId": repo, "sha": _commit_id(files), "private": False,
                                    "siblings": [{"rfilename": name} for name in sorted(files)]})
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path):
            repo, revision, prefix = match.groups()
            files = self._branch(repo, revision)
            if files is None:
                return self._error(404, f"{repo}@{revision} not found")
            prefix = (prefix or "").strip("/")
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            entries, folders = [], set()
            for name in sorted(files):
                if prefix and not name.startswith(prefix + "/"):
                    continue
                rest = name[len(prefix) + 1:] if prefix else name
                if not recursive and "/" in rest:
                    folders.add((prefix + "/" if prefix else "") + rest.split("/")[0])
                    continue
                entries.append({"type": "file", "path": name, "size": len(files[name]), "oid": _sha(files[name])})
            entries += [{"type": "directory", "path": folder, "oid": _sha(folder.encode())} for folder in sorted(folders)]
            return self._send(200, entries)
        if match := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo, revision, name = match.groups()
            files = self._branch(repo, revision)
            if files is None or name not in files:
                return self._error(404, f"{name} not found in {repo}@{revision}")
            data = files[name]
            return self._send(200, data, {"ETag": f'"{_sha(data)}"', "X-Repo-Commit": _commit_id(files),
                                          "Content-Type": "application/octet-stream"})
        self._error(404, f"the fake hub does not serve GET {path}")

    # ------------------------------------------------------------------ POST

    def do_POST(self):
        self._record()
        path = unquote(urlparse(self.path).path)
        body = self._body()
        hub = self.hub
        if path == "/api/validate-yaml":  # the model card's metadata, checked before a README.md is committed
            with hub.lock:
                hub.validated.append(json.loads(body)["content"])
            return self._send(200, {})
        if path == "/api/repos/create":
            request = json.loads(body)
            # a bare name goes under the namespace of the token's owner, as on the Hub
            repo = f"{request.get('organization') or hub.user}/{request['name']}"
            with hub.lock:
                if repo in hub.repos:
                    return self._send(409, {"error": "You already created this model repo", "url": f"/{repo}"})
                hub.repos[repo] = {"main": {}}
                # huggingface_hub 2.x sends "visibility"; older releases sent "private"
                hub.private[repo] = request.get("visibility", "private" if request.get("private") else "public") \
                    == "private"
            return self._send(200, {"url": f"http://{self.headers['Host']}/{repo}", "name": repo})
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/branch/([^/]+)", path):
            repo, branch = match.groups()
            with hub.lock:
                if repo not in hub.repos:
                    return self._error(404, f"{repo} not found")
                if branch in hub.repos[repo]:
                    return self._error(409, f"branch {branch} already exists")
                hub.repos[repo][branch] = dict(hub.repos[repo]["main"])
            return self._send(200, {})
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/preupload/([^/]+)", path):
            repo, revision = match.groups()
            if self._branch(repo, revision) is None:
                return self._error(404, f"{repo}@{revision} not found")
            files = json.loads(body)["files"]
            return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                              for f in files]})
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/commit/([^/]+)", path):
            repo, revision = match.groups()
            with hub.lock:
                files = self._branch(repo, revision)
                if files is None:
                    return self._error(404, f"{repo}@{revision} not found")
                message, added, deleted = "", [], []
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    value = item["value"]
                    if item["key"] == "header":
                        message = value["summary"]
                    elif item["key"] == "file":
                        files[value["path"]] = base64.b64decode(value["content"])
                        added.append(value["path"])
                    elif item["key"] == "deletedFile":
                        files.pop(value["path"], None)
                        deleted.append(value["path"])
                    elif item["key"] == "deletedFolder":
                        for name in [n for n in files if n.startswith(value["path"].rstrip("/") + "/")]:
                            files.pop(name)
                            deleted.append(name)
                    else:
                        return self._error(400, f"the fake hub does not take {item['key']} operations")
                hub.commits.append(Commit(repo, revision, message, added, deleted))
                oid = _commit_id(files)
            return self._send(200, {"commitUrl": f"http://{self.headers['Host']}/{repo}/commit/{oid}",
                                    "commitOid": oid})
        self._error(404, f"the fake hub does not serve POST {path}")


def serve() -> tuple[FakeHub, ThreadingHTTPServer]:
    """Start a fake hub on a free localhost port in a daemon thread: (its state, the server)."""
    hub = FakeHub()
    handler = type("BoundHandler", (Handler,), {"hub": hub})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return hub, server
