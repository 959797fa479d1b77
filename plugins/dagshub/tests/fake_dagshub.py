"""A local HTTP server standing in for dagshub.com: the part of DagsHub's API that ``dagshub.upload.Repo``
calls to commit files (the repository's info, a branch's last commit, the multipart PUT of the content
API), and the repository's MLflow server at ``/<owner>/<repo>.mlflow``, passed on to a real ``mlflow
server`` (``mlflow_down = True``: it answers 503, an outage). Point ``dagshub.common.config.host`` at it.
Commits are kept as {branch: {path in repo: bytes}}, with the Authorization header of every request.
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import urllib.error
import urllib.request
from urllib.parse import unquote

USER = {"id": 1, "login": "owner", "full_name": "", "avatar_url": None, "public_email": None, "website": None,
        "company": None, "description": None, "username": "owner"}


@dataclass
class FakeDagsHub:
    owner: str
    name: str
    mlflow: str  # the MLflow server the repository's /<owner>/<repo>.mlflow passes requests on to
    mlflow_down: bool = False
    default_branch: str = "main"
    files: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})  # branch -> path -> content
    messages: list[str] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)

    def repo_info(self) -> dict:
        return {"id": 1, "owner": USER, "name": self.name, "full_name": f"{self.owner}/{self.name}",
                "description": "", "private": False, "fork": False, "parent": None, "empty": False, "mirror": False,
                "size": 0, "html_url": "", "ssh_url": None, "clone_url": "", "website": None, "stars_count": 0,
                "forks_count": 0, "watchers_count": 0, "open_issues_count": 0,
                "default_branch": self.default_branch, "created_at": "", "updated_at": "", "permissions": None}

    def branch_info(self, branch: str) -> dict:
        commit = {"id": f"{len(self.messages):040d}", "message": "", "url": "", "author": None, "committer": None,
                  "added": None, "removed": None, "modified": None, "timestamp": ""}
        return {"name": branch, "commit": commit}


def serve(fake: FakeDagsHub) -> tuple[ThreadingHTTPServer, str]:
    """Start ``fake`` on a free local port (a daemon thread); returns the server and its URL."""
    repo = f"/api/v1/repos/{fake.owner}/{fake.name}"
    mlflow = f"/{fake.owner}/{fake.name}.mlflow"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def send(self, status: int, body: dict | None = None, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(status)
            for key, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                               **(headers or {})}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def pass_to_mlflow(self):
            if fake.mlflow_down:
                return self.send(503, {"message": "unavailable"})
            length = int(self.headers.get("Content-Length") or 0)
            request = urllib.request.Request(fake.mlflow + self.path[len(mlflow):], method=self.command,
                                             data=self.rfile.read(length) if length else None,
                                             headers={"Content-Type": self.headers.get("Content-Type", "")})
            try:
                with urllib.request.urlopen(request) as response:
                    status, data, kind = response.status, response.read(), response.headers["Content-Type"]
            except urllib.error.HTTPError as error:
                status, data, kind = error.code, error.read(), error.headers["Content-Type"]
            self.send_response(status)
            self.send_header("Content-Type", kind or "application/octet-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            fake.authorizations.append(self.headers.get("Authorization"))
            if self.path.startswith(mlflow):
                return self.pass_to_mlflow()
            self.send(404, {"message": "not found"})

        def do_GET(self):
            fake.authorizations.append(self.headers.get("Authorization"))
            if self.path.startswith(mlflow):
                return self.pass_to_mlflow()
            branch = re.fullmatch(rf"{repo}/branches/([^/?]+)", self.path)
            if self.path == repo:
                self.send(200, fake.repo_info())
            elif branch and unquote(branch[1]) in fake.files:
                self.send(200, fake.branch_info(unquote(branch[1])))
            else:
                self.send(404, {"message": "not found"})

        def do_PUT(self):
            fake.authorizations.append(self.headers.get("Authorization"))
            if self.path.startswith(mlflow):
                return self.pass_to_mlflow()
            upload = re.fullmatch(rf"{repo}/content/([^/]+)/(.*)", self.path)
            if not upload:
                return self.send(404, {"message": "not found"})
            body = self.rfile.read(int(self.headers["Content-Length"]))
            head = f"Content-Type: {self.headers['Content-Type']}\r\n\r\n".encode()
            form = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
            folder = unquote(upload[2])
            branch = fake.files.setdefault(unquote(upload[1]), {})
            for part in form.iter_parts():
                if part.get_param("name", header="content-disposition") == "files":
                    branch[f"{folder}/{part.get_filename()}"] = part.get_payload(decode=True)
                elif part.get_param("name", header="content-disposition") == "commit_summary":
                    fake.messages.append(part.get_content().strip())
            self.send(200, {}, {"ETag": f"{len(fake.messages):040d}"})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
