"""A Hugging Face hub on loopback, serving local directories the way huggingface-hub
expects (checked with huggingface-hub 2.4): the model API (`/api/models/{repo}` and
`.../revision/{rev}`), the tree listing, and `/{repo}/resolve/{rev}/{path}` with
`X-Repo-Commit`, `ETag`/`X-Linked-Etag` (an LFS file's sha256, its oid),
`X-Linked-Size` and ranges (206). Failures carry the hub's `X-Error-Code`
(`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`, `GatedRepo`).

Tests point `HF_ENDPOINT` at `FakeHub.url` (with `HF_HUB_DISABLE_XET=1` and a private
`HF_HOME`, see `FakeHub.env`) in the environment of the process under test, since
huggingface-hub reads them at import. The hub counts the bytes it served, can be
slowed to a rate (so a test can kill a download half-way), can serve a file whose
bytes differ from its advertised oid, and can misbehave on a file's whole download
(ranged reads stay correct): "endless" (no Content-Length, the file's bytes then
more, up to ENDLESS_BYTES), "die" (its full Content-Length, half the bytes, then
the connection dropped) or "truncate" (no Content-Length, half the bytes, then a
clean close).
"""

import hashlib
import json
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, Optional, Set
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".bin", ".model", ".tiktoken")
CHUNK = 1 << 16
ENDLESS_BYTES = 256 << 20  # what an "endless" download sends at most (a bounded test)
MISBEHAVIOURS = ("endless", "die", "truncate")


@dataclass
class HubFile:
    path: Path
    size: int
    sha256: str
    git_oid: str  # sha1 of the git blob (the oid of a file not in LFS)
    lfs: bool


@dataclass
class HubRepo:
    commit: str
    files: Dict[str, HubFile]
    gated: bool = False
    corrupt: Set[str] = field(default_factory=set)  # served with one byte flipped
    misbehave: Dict[str, str] = field(default_factory=dict)  # name -> a MISBEHAVIOURS mode


def _describe(path: Path) -> HubFile:
    sha, git = hashlib.sha256(), hashlib.sha1()
    size = path.stat().st_size
    git.update(f"blob {size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
            git.update(chunk)
    return HubFile(path, size, sha.hexdigest(), git.hexdigest(), path.name.endswith(LFS_SUFFIXES))


class FakeHub:
    """Start with `with FakeHub() as hub:`; `hub.add(repo, directory)` serves it."""

    def __init__(self, rate: Optional[float] = None):
        self.repos: Dict[str, HubRepo] = {}
        self.rate = rate  # bytes/s per download; None: as fast as it goes
        self.bytes_served = 0
        self.requests = []  # (method, path) in arrival order
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def env(self, hf_home) -> dict:
        """The environment a process under test needs to use this hub."""
        return {"HF_ENDPOINT": self.url, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(hf_home),
                "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1"}

    def add(self, repo: str, directory, gated: bool = False, corrupt=(),
            misbehave=None) -> HubRepo:
        directory = Path(directory)
        files = {p.name: _describe(p) for p in sorted(directory.iterdir()) if p.is_file()}
        commit = hashlib.sha1(repo.encode() + b"".join(
            f.sha256.encode() for f in files.values())).hexdigest()
        assert all(m in MISBEHAVIOURS for m in (misbehave or {}).values()), misbehave
        self.repos[repo] = HubRepo(commit, files, gated, set(corrupt), dict(misbehave or {}))
        return self.repos[repo]

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    def _count(self, n: int):
        with self._lock:
            self.bytes_served += n


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: tests read their own output
            pass

        def do_HEAD(self):
            self._route(body=False)

        def do_GET(self):
            self._route(body=True)

        def _fail(self, status: int, code: str, body: bool):
            payload = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if body:
                self.wfile.write(payload)

        def _json(self, obj, body: bool):
            payload = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if body:
                self.wfile.write(payload)

        def _repo(self, owner, name, body):
            repo = hub.repos.get(f"{owner}/{name}")
            if repo is None:
                self._fail(404, "RepoNotFound", body)
            elif repo.gated:
                self._fail(403, "GatedRepo", body)
            return None if repo is None or repo.gated else repo

        def _revision(self, repo: HubRepo, rev: str, body) -> bool:
            if unquote(rev) in ("main", repo.commit):
                return True
            self._fail(404, "RevisionNotFound", body)
            return False

        def _route(self, body: bool):
            url = urlparse(self.path)
            parts = [unquote(p) for p in url.path.split("/") if p]
            hub.requests.append((self.command, url.path))
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo = self._repo(parts[2], parts[3], body)
                if repo is None:
                    return
                rest = parts[4:]
                rev = "main"
                if rest[:1] in (["revision"], ["tree"]) and len(rest) >= 2:
                    rev = rest[1]
                if not self._revision(repo, rev, body):
                    return
                if rest[:1] == ["tree"]:
                    return self._json([_tree_entry(n, f) for n, f in repo.files.items()], body)
                return self._json(_model_info(f"{parts[2]}/{parts[3]}", repo), body)
            if len(parts) >= 5 and parts[2] == "resolve":
                repo = self._repo(parts[0], parts[1], body)
                if repo is None or not self._revision(repo, parts[3], body):
                    return
                f = repo.files.get("/".join(parts[4:]))
                if f is None:
                    return self._fail(404, "EntryNotFound", body)
                return self._file(repo, "/".join(parts[4:]), f, body)
            self._fail(404, "RepoNotFound", body)

        def _file(self, repo: HubRepo, name: str, f: HubFile, body: bool):
            start, end = 0, f.size
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                a, _, b = rng[6:].partition("-")
                start = int(a) if a else 0
                end = int(b) + 1 if b else f.size
                end = min(end, f.size)
            mode = None if rng or not body else repo.misbehave.get(name)
            self.send_response(206 if rng else 200)
            self.send_header("X-Repo-Commit", repo.commit)
            etag = f.sha256 if f.lfs else f.git_oid
            self.send_header("ETag", f'"{etag}"')
            if f.lfs:
                self.send_header("X-Linked-Etag", f'"{etag}"')
                self.send_header("X-Linked-Size", str(f.size))
            if mode in ("endless", "truncate"):  # the body ends when the connection does
                self.send_header("Connection", "close")
                self.close_connection = True
            else:
                self.send_header("Content-Length", str(end - start))
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{f.size}")
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if not body:
                return
            if mode is not None:
                return self._misbehave(mode, f)
            flip = name in repo.corrupt
            with open(f.path, "rb") as src:
                src.seek(start)
                pos = start
                t0 = time.perf_counter()
                sent = 0
                while pos < end:
                    chunk = bytearray(src.read(min(CHUNK, end - pos)))
                    if flip and pos <= f.size // 2 < pos + len(chunk):
                        chunk[f.size // 2 - pos] ^= 0xFF
                    try:
                        self.wfile.write(chunk)
                    except (BrokenPipeError, ConnectionResetError):
                        return
                    hub._count(len(chunk))
                    pos += len(chunk)
                    sent += len(chunk)
                    if hub.rate:
                        ahead = sent / hub.rate - (time.perf_counter() - t0)
                        if ahead > 0:
                            time.sleep(ahead)

        def _misbehave(self, mode: str, f: HubFile):
            data = f.path.read_bytes()
            if mode in ("die", "truncate"):
                data = data[:f.size // 2]
            sent = 0
            try:
                while sent < (ENDLESS_BYTES if mode == "endless" else len(data)):
                    chunk = data[sent:sent + CHUNK] if sent < len(data) else bytes(CHUNK)
                    self.wfile.write(chunk)
                    hub._count(len(chunk))
                    sent += len(chunk)
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass
            self.close_connection = True
            if mode == "die":  # dropped, not closed: the client sees a reset
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))

    return Handler


def _tree_entry(name: str, f: HubFile) -> dict:
    entry = {"type": "file", "path": name, "size": f.size, "oid": f.git_oid}
    if f.lfs:
        entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
    return entry


def _model_info(repo_id: str, repo: HubRepo) -> dict:
    siblings = []
    for name, f in repo.files.items():
        s = {"rfilename": name, "size": f.size, "blobId": f.git_oid}
        if f.lfs:
            s["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
        siblings.append(s)
    return {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
            "gated": False, "disabled": False, "siblings": siblings, "tags": [],
            "lastModified": "2026-12-01T00:00:00.000Z"}
