"""A small Hugging Face Hub stand-in for the tests: the endpoints `huggingface_hub` 2.x calls when transformers pushes
and loads a model, served from a temporary folder over plain HTTP.

The one PyPI package found for this (hf-local-hub) needs a Go server binary it does not ship, so this is written from
what the client sends (huggingface_hub's `hf_api.py`, `_commit_api.py`, `file_download.py`, `utils/_http.py`):

    POST /api/repos/create                               create a repo (409 with its url when it exists)
    POST /api/validate-yaml                              README.md metadata must be a YAML mapping
    POST /api/models/{repo}/preupload/{revision}         every file is `regular`: sent inline in the commit
    POST /api/models/{repo}/commit/{revision}            ndjson: header, then file / deletedFile / deletedFolder
    POST /api/models/{repo}/branch/{branch}              a branch from `startingPoint` (default: main)
    GET  /api/models/{repo}[/revision/{revision}]        model_info: sha, siblings, cardData from README.md
    GET  /api/models/{repo}/tree/{revision}[/{path}]     list_repo_tree (one page)
    GET  /api/agent-harnesses                            an empty registry (the client's agent detection)
    HEAD/GET /{repo}/resolve/{revision}/{path}           file bytes with X-Repo-Commit, ETag, Content-Length

Neither LFS nor Xet is involved, so HF_HUB_DISABLE_XET is not needed even with hf-xet installed: the client takes the
Xet path only for files that preupload calls `lfs` and for downloads whose response carries `X-Xet-Hash`.
Writes (POST) need a bearer token, any token. Errors carry the `X-Error-Code` the client maps to exceptions
(RepoNotFound, RevisionNotFound, EntryNotFound).
A revision is a branch name or a full commit sha; every commit gets a new sha and old ones stay resolvable. Dataset
and space repos, LFS, pull requests, tags and private-repo access control are not served.
"""

import base64
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

USER = "zoo-user"  # the namespace of repos created without one (the Hub takes the token's user)


def git_blob_sha(data: bytes) -> str:
    """The git object id of a blob: what the Hub uses as the ETag and oid of a regular file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    sha: str
    parent: str | None
    message: str
    files: dict[str, str]  # path -> blob sha
    date: str


@dataclass
class Repo:
    repo_id: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    commits: dict[str, Commit] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit | None:
        sha = self.branches.get(revision, revision)
        return self.commits.get(sha)


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, commit: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.commit = status, message, code, commit


class HubServer:
    """The Hub stand-in on 127.0.0.1 (a free port), serving from a thread; `endpoint` is its base URL."""

    def __init__(self, storage: Path) -> None:
        self.blobs = Path(storage)
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.repos: dict[str, Repo] = {}
        self.lock = threading.Lock()  # the handler threads share `repos`
        self.requests: list[str] = []  # "METHOD path" of every request
        self.not_served: list[str] = []  # the requests no endpoint here answers: a client call this file lacks
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self.httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="hub-server", daemon=True)

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()

    # --- storage -----------------------------------------------------------------------------------------------

    def repo(self, repo_id: str) -> Repo:
        if repo_id not in self.repos:
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return self.repos[repo_id]

    def commit_at(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    def read_blob(self, sha: str) -> bytes:
        return (self.blobs / sha).read_bytes()

    def add_commit(self, repo: Repo, branch: str, files: dict[str, str], message: str) -> Commit:
        parent = repo.branches.get(branch)
        stamp = f"{repo.repo_id}\n{parent}\n{message}\n{time.time_ns()}\n{json.dumps(files, sort_keys=True)}"
        commit = Commit(
            sha=hashlib.sha1(stamp.encode()).hexdigest(),
            parent=parent,
            message=message,
            files=files,
            date=time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()),
        )
        repo.commits[commit.sha] = commit
        repo.branches[branch] = commit.sha
        return commit

    # --- endpoints ---------------------------------------------------------------------------------------------

    def create_repo(self, body: dict) -> tuple[int, dict]:
        if body.get("type", "model") != "model":
            raise HubError(400, "only model repos are served")
        repo_id = f"{body.get('organization') or USER}/{body['name']}"
        url = f"{self.endpoint}/{repo_id}"
        if repo_id in self.repos:
            return 409, {"error": "You already created this model repo", "url": url}
        repo = Repo(repo_id, body.get("visibility") == "private" or bool(body.get("private")))  # 2.x: visibility
        self.add_commit(repo, "main", {}, "initial commit")
        self.repos[repo_id] = repo
        return 200, {"url": url, "name": repo_id, "id": repo_id}

    def preupload(self, repo_id: str, revision: str, body: dict) -> dict:
        repo = self.repo(repo_id)
        commit = repo.resolve(revision)  # a branch about to be created has no commit yet: nothing to compare with
        existing = commit.files if commit else {}
        files = [
            # the oid lets the client skip files that did not change, as it does against the Hub
            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": existing.get(f["path"])}
            for f in body["files"]
        ]
        return {"files": files, "commitOid": commit.sha if commit else None}

    def commit(self, repo_id: str, revision: str, lines: list[dict], query: dict) -> dict:
        repo = self.repo(repo_id)
        if query.get("create_pr"):
            raise HubError(400, "pull requests are not served")
        if revision not in repo.branches:
            raise HubError(404, f"Invalid rev id: {revision} (commits go to a branch)", "RevisionNotFound")
        files = dict(repo.commits[repo.branches[revision]].files)
        header = next(line["value"] for line in lines if line["key"] == "header")
        parent = header.get("parentCommit")
        if parent and parent != repo.branches[revision]:
            raise HubError(412, f"{revision} has moved past parentCommit {parent}")
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "file":
                data = base64.b64decode(value["content"])
                sha = git_blob_sha(data)
                (self.blobs / sha).write_bytes(data)
                files[value["path"]] = sha
            elif key == "deletedFile":
                if files.pop(value["path"], None) is None:
                    raise HubError(404, f"A file with this name doesn't exist: {value['path']}", "EntryNotFound")
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                files = {path: sha for path, sha in files.items() if not path.startswith(prefix)}
            elif key != "header":
                raise HubError(400, f"commit operation {key!r} is not served (only regular files)")
        commit = self.add_commit(repo, revision, files, header.get("summary", ""))
        return {
            "commitUrl": f"{self.endpoint}/{repo_id}/commit/{commit.sha}",
            "commitOid": commit.sha,
            "success": True,
        }

    def create_branch(self, repo_id: str, branch: str, body: dict) -> tuple[int, dict]:
        repo = self.repo(repo_id)
        if branch in repo.branches:
            return 409, {"error": f"Reference already exists: refs/heads/{branch}"}
        repo.branches[branch] = self.commit_at(repo, body.get("startingPoint") or "main").sha
        return 200, {}

    def model_info(self, repo_id: str, revision: str) -> dict:
        repo = self.repo(repo_id)
        commit = self.commit_at(repo, revision)
        card = self._card_data(commit)
        return {
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0],
            "sha": commit.sha,
            "private": repo.private,
            "lastModified": commit.date,
            "tags": card.get("tags") or [],
            "pipeline_tag": card.get("pipeline_tag"),
            "library_name": card.get("library_name"),
            "cardData": card or None,
            "siblings": [
                {"rfilename": path, "blobId": sha, "size": (self.blobs / sha).stat().st_size}
                for path, sha in sorted(commit.files.items())
            ],
        }

    def _card_data(self, commit: Commit) -> dict:
        if "README.md" not in commit.files:
            return {}
        return _front_matter(self.read_blob(commit.files["README.md"]).decode()) or {}

    def tree(self, repo_id: str, revision: str, path: str, recursive: bool) -> list[dict]:
        commit = self.commit_at(self.repo(repo_id), revision)
        prefix = f"{path.strip('/')}/" if path.strip("/") else ""
        if prefix and not any(name.startswith(prefix) for name in commit.files):
            raise HubError(404, f"{path} does not exist at {revision}", "EntryNotFound", commit.sha)
        entries: dict[str, dict] = {}
        for name, sha in sorted(commit.files.items()):
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix) :].split("/")
            for depth in range(1, len(parts) if recursive else min(len(parts), 2)):  # the folders on the way
                folder = prefix + "/".join(parts[:depth])
                entries.setdefault(folder, {"type": "directory", "oid": sha, "size": 0, "path": folder})
            if recursive or len(parts) == 1:
                entries[name] = {"type": "file", "oid": sha, "size": (self.blobs / sha).stat().st_size, "path": name}
        return list(entries.values())

    def resolve(self, repo_id: str, revision: str, path: str) -> tuple[Commit, bytes]:
        commit = self.commit_at(self.repo(repo_id), revision)
        if path not in commit.files:
            # the commit header lets the client cache "this file does not exist at this commit"
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound", commit.sha)
        return commit, self.read_blob(commit.files[path])


def _front_matter(text: str) -> dict | None:
    """The YAML mapping between the leading `---` lines of a README.md, None when there is none."""
    if not text.startswith("---\n"):
        return None
    end = text.find("\n---", 4)
    if end < 0:
        raise ValueError("the metadata block opened by --- is never closed")
    data = yaml.safe_load(text[4:end])
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"the metadata must be a mapping, not {type(data).__name__}")
    return data


def _handler_for(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects

        def log_message(self, format, *args) -> None:  # quiet: pytest shows failures, not access logs
            pass

        def do_HEAD(self) -> None:
            self._serve("HEAD")

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))  # the client always sends it

        def _send(self, status: int, body: bytes, headers: dict[str, str], method: str) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(body)

        def _json(self, status: int, data, method: str, extra: dict[str, str] | None = None) -> None:
            self._send(
                status, json.dumps(data).encode(), {"Content-Type": "application/json", **(extra or {})}, method
            )

        def _serve(self, method: str) -> None:
            url = urlsplit(self.path)
            # split before unquoting: a revision such as `refs%2Fpr%2F1` is one segment
            parts = [unquote(part) for part in url.path.strip("/").split("/")]
            query = {key: values[-1] for key, values in parse_qs(url.query).items()}
            body = self._body() if method == "POST" else b""
            hub.requests.append(f"{method} {url.path}")
            try:
                with hub.lock:
                    self._route(method, parts, query, body)
            except HubError as error:
                headers = {"X-Error-Message": error.message}
                if error.code:
                    headers["X-Error-Code"] = error.code
                if error.commit:
                    headers["X-Repo-Commit"] = error.commit
                self._json(error.status, {"error": error.message}, method, headers)
            except (KeyError, ValueError, TypeError) as error:  # a request this server does not understand
                self._json(400, {"error": f"bad request: {error!r}"}, method)

        def _route(self, method: str, parts: list[str], query: dict, body: bytes) -> None:
            authorized = self.headers.get("Authorization", "").startswith("Bearer ")
            if parts[0] == "api":
                if method == "POST" and not authorized:
                    raise HubError(401, "Invalid credentials in Authorization header")
                self._api(method, parts[1:], query, body)
            elif len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
                commit, data = hub.resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
                headers = {
                    "X-Repo-Commit": commit.sha,
                    "ETag": f'"{git_blob_sha(data)}"',
                    "Content-Type": "application/octet-stream",
                    "Accept-Ranges": "none",
                }
                self._send(200, data, headers, method)
            else:
                self._not_served(method, parts)

        def _api(self, method: str, parts: list[str], query: dict, body: bytes) -> None:
            if method == "POST" and parts == ["repos", "create"]:
                self._json(*hub.create_repo(json.loads(body)), method)
            elif method == "POST" and parts == ["validate-yaml"]:
                try:
                    _front_matter(json.loads(body)["content"])
                except (ValueError, yaml.YAMLError) as error:
                    self._json(400, {"errors": [{"message": str(error)}], "warnings": []}, method)
                    return
                self._json(200, {"errors": [], "warnings": []}, method)
            elif method == "GET" and parts == ["agent-harnesses"]:  # the client's agent detection, once a process
                self._json(200, {"standardEnvVars": [], "harnesses": {}}, method)
            elif len(parts) >= 3 and parts[0] == "models":
                repo_id, rest = f"{parts[1]}/{parts[2]}", parts[3:]
                if method == "GET" and not rest:
                    self._json(200, hub.model_info(repo_id, "main"), method)
                elif method == "GET" and len(rest) == 2 and rest[0] == "revision":
                    self._json(200, hub.model_info(repo_id, rest[1]), method)
                elif method == "GET" and len(rest) >= 2 and rest[0] == "tree":
                    recursive = query.get("recursive", "").lower() in ("1", "true")
                    self._json(200, hub.tree(repo_id, rest[1], "/".join(rest[2:]), recursive), method)
                elif method == "POST" and len(rest) == 2 and rest[0] == "preupload":
                    self._json(200, hub.preupload(repo_id, rest[1], json.loads(body)), method)
                elif method == "POST" and len(rest) == 2 and rest[0] == "commit":
                    lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                    self._json(200, hub.commit(repo_id, rest[1], lines, query), method)
                elif method == "POST" and len(rest) == 2 and rest[0] == "branch":
                    self._json(*hub.create_branch(repo_id, rest[1], json.loads(body or b"{}")), method)
                else:
                    self._not_served(method, ["api", *parts])
            else:
                self._not_served(method, ["api", *parts])

        def _not_served(self, method: str, parts: list[str]) -> None:
            request = f"{method} /{'/'.join(parts)}"
            hub.not_served.append(request)
            raise HubError(404, f"not served: {request}")

    return Handler


def use_hub(monkeypatch, endpoint: str, home: Path) -> None:
    """Point huggingface_hub and transformers, in this process and in the processes it starts, at `endpoint`, with a
    dummy token and caches under `home`; `monkeypatch` undoes it all.

    The environment alone is not enough in this process: huggingface_hub reads HF_ENDPOINT, HF_HOME, HF_HUB_CACHE and
    HF_HUB_OFFLINE (which the suite sets) into `huggingface_hub.constants` when it is imported, and transformers keeps
    one `HfApi` whose endpoint was fixed when it was made. So those constants are patched and that instance dropped,
    as well as the environment being set for subprocesses (which read it afresh). Every other client code path reads
    the constants when called (checked against huggingface_hub 2.4).
    """
    import transformers.utils.hub
    from huggingface_hub import constants

    home.mkdir(parents=True, exist_ok=True)
    environment = {
        "HF_ENDPOINT": endpoint,
        "HF_TOKEN": "hf_dummy_token_for_the_test_hub",
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_MODULES_CACHE": str(home / "modules"),  # remote code loaded in subprocesses lands here
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    # every cache and state path under HF_HOME (the hub cache, the stored token, the agent registry, ...) moves too
    old_home = constants.HF_HOME
    for name, value in list(vars(constants).items()):
        if name.isupper() and isinstance(value, str) and value.startswith(old_home):
            monkeypatch.setattr(constants, name, str(home) + value[len(old_home) :])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", None)
