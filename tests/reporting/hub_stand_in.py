"""A local stand-in for the Hugging Face Hub's HTTP API: the endpoints huggingface_hub calls to create a repo, read
its info, validate a card and commit files (preupload + commit, every file "regular", no LFS). Nothing leaves the
machine. Tokens: "write-token" may do anything, "read-token" may only read (HTTP 403 on any write), no token is
HTTP 401, as on the Hub."""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WRITE_TOKEN, READ_TOKEN = "write-token", "read-token"
USER = "me"  # the namespace of a repo id given without one
REPO_PATH = re.compile(r"/api/datasets/([^/]+/[^/]+)(?:/revision/[^/?]+)?(?:\?.*)?")
WRITE_PATH = re.compile(r"/api/datasets/([^/]+/[^/]+)/(preupload|commit)/[^/?]+(?:\?.*)?")


class HubStandIn:
    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}  # "dataset:ns/name" -> {"private": ..., "files": {path: bytes}}
        self.commits: list[dict] = []  # {"repo": ..., "files": [paths], "summary": ...}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, token)
        self.revoked = False  # True: the write token lost its write access
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.hub = self
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def repo(self, repo_id: str) -> dict | None:
        return self.repos.get(f"dataset:{repo_id}")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    @property
    def hub(self) -> HubStandIn:
        return self.server.hub

    def _reply(self, status: int, body: dict | None = None) -> None:
        data = json.dumps(body or {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status >= 400:
            self.send_header("X-Error-Message", (body or {}).get("error", "error"))
        self.end_headers()
        self.wfile.write(data)

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[len("Bearer "):] if auth.startswith("Bearer ") else None

    def _refuse_writes(self) -> bool:
        token = self._token()
        if token == WRITE_TOKEN and not self.hub.revoked:
            return False
        if token is None:
            self._reply(401, {"error": "Invalid username or password."})
        else:
            self._reply(403, {"error": "You don't have the rights to write to this repo."})
        return True

    def do_GET(self):  # noqa: N802
        self.hub.requests.append(("GET", self.path, self._token()))
        match = REPO_PATH.fullmatch(self.path)
        repo = self.hub.repo(match.group(1)) if match else None
        if repo is None:
            return self._reply(404, {"error": "Repository not found"})
        self._reply(200, {"id": match.group(1), "sha": "0" * 40, "private": repo["private"],
                          "siblings": [{"rfilename": f} for f in repo["files"]]})

    def do_POST(self):  # noqa: N802
        self.hub.requests.append(("POST", self.path, self._token()))
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/api/validate-yaml":
            return self._reply(200, {})
        if self.path == "/api/repos/create":
            return None if self._refuse_writes() else self._create(json.loads(body))
        match = WRITE_PATH.fullmatch(self.path)
        if not match or self.hub.repo(match.group(1)) is None:
            return self._reply(404, {"error": "Repository not found"})
        if self._refuse_writes():
            return None
        if match.group(2) == "preupload":
            return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                               for f in json.loads(body)["files"]]})
        return self._commit(match.group(1), [json.loads(line) for line in body.splitlines() if line.strip()])

    def _create(self, payload: dict) -> None:
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
        key = f"{payload.get('type', 'model')}:{repo_id}"
        url = f"{self.hub.url}/datasets/{repo_id}"
        if key in self.hub.repos:  # the Hub answers a conflict with the existing repo's url
            return self._reply(409, {"error": "You already created this dataset repo", "url": url})
        self.hub.repos[key] = {"private": payload.get("visibility") == "private", "files": {}}
        self._reply(200, {"url": url})

    def _commit(self, repo_id: str, lines: list[dict]) -> None:
        files = [line["value"] for line in lines if line["key"] == "file"]
        for f in files:
            self.hub.repo(repo_id)["files"][f["path"]] = base64.b64decode(f["content"])
        summary = next(line["value"]["summary"] for line in lines if line["key"] == "header")
        self.hub.commits.append({"repo": repo_id, "files": [f["path"] for f in files], "summary": summary})
        self._reply(200, {"commitUrl": f"{self.hub.url}/datasets/{repo_id}/commit/{'1' * 40}",
                          "commitOid": "1" * 40, "pullRequestUrl": None})
