"""Registries for tests: Debian's `docker-registry` (the CNCF distribution registry) run on
127.0.0.1, with the registry's own basic auth (htpasswd) or token auth (a small token
server of the test's own that signs JWTs with openssl), a push helper, and an in-memory
fake for unit tests behind `httpx.MockTransport`.

What the real registry served is read from its JSON log ("response completed" lines), so
tests count blob downloads at the registry itself, not at the client.
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import ctypes.util
import hashlib
import json
import secrets
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, urlparse

import httpx

from tests.imagebuild import BuiltImage, digest_of
from tests.waiting import wait_until

REGISTRY_BINARY = shutil.which("docker-registry") or "/usr/bin/docker-registry"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
TOKEN_ISSUER = "cri-shim-test-issuer"
TOKEN_SERVICE = "cri-shim-test-registry"

AuthMode = Literal["none", "basic", "token"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bcrypt_hash(password: str) -> str:
    """A bcrypt hash for htpasswd (the registry accepts nothing else), from the C library's
    crypt(3) (libxcrypt): no Python bcrypt package needed."""
    lib = ctypes.CDLL(ctypes.util.find_library("crypt") or "libcrypt.so.1")
    lib.crypt_gensalt.restype = ctypes.c_char_p
    lib.crypt_gensalt.argtypes = [ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p, ctypes.c_int]
    lib.crypt.restype = ctypes.c_char_p
    lib.crypt.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    salt = lib.crypt_gensalt(b"$2y$", 5, None, 0)
    hashed = lib.crypt(password.encode(), salt)
    if not hashed or not hashed.startswith(b"$2"):
        raise RuntimeError("libcrypt cannot make bcrypt hashes")
    return str(hashed.decode())


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


# --- the token server ------------------------------------------------------------------
@dataclass
class TokenServer:
    """The distribution token protocol: GET /token?service=&scope= with optional basic
    credentials, and POST /token (OAuth2 refresh_token or password grant). Grants the
    `pull` (and, for `admin`, `push`) actions a user has on the repositories it may read;
    anonymous callers get the `public` repositories. Tokens are RS256 JWTs whose `kid` is
    the libtrust key ID of the certificate the registry trusts."""

    base: Path
    users: dict[str, str]  # name -> password
    readable: dict[str, set[str]] = field(default_factory=dict)  # user -> repositories
    public: set[str] = field(default_factory=set)
    refresh_tokens: dict[str, str] = field(default_factory=dict)  # token -> user
    requests: list[str] = field(default_factory=list)
    port: int = 0
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    @property
    def key(self) -> Path:
        return self.base / "token.key"

    @property
    def cert(self) -> Path:
        return self.base / "token.crt"

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def start(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                str(self.key),
                "-out",
                str(self.cert),
                "-days",
                "2",
                "-subj",
                "/CN=cri-shim-test",
            ],
            check=True,
            capture_output=True,
        )
        der = subprocess.run(
            ["openssl", "pkey", "-in", str(self.key), "-pubout", "-outform", "DER"],
            check=True,
            capture_output=True,
        ).stdout
        # libtrust's key ID, which the registry derives from each trusted certificate.
        raw = base64.b32encode(hashlib.sha256(der).digest()[:30]).decode().rstrip("=")
        self._kid = ":".join(raw[i : i + 4] for i in range(0, len(raw), 4))
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                server.requests.append(f"GET {url.path}")
                user = server._basic_user(self.headers.get("Authorization"))
                self._answer(server._grant(user, query.get("service", ""), query.get("scope", "")))

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                form = {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode()).items()}
                server.requests.append(f"POST {urlparse(self.path).path}")
                user: str | None = None
                if form.get("grant_type") == "refresh_token":
                    user = server.refresh_tokens.get(form.get("refresh_token", ""), "")
                elif form.get("grant_type") == "password":
                    name = form.get("username", "")
                    ok = server.users.get(name) == form.get("password")
                    user = name if ok else ""
                result = server._grant(user, form.get("service", ""), form.get("scope", ""))
                if result[0] == 200:
                    body = json.loads(result[1])
                    body["access_token"] = body.pop("token")
                    result = (200, json.dumps(body).encode())
                self._answer(result)

            def _answer(self, result: tuple[int, bytes]) -> None:
                status, body = result
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _basic_user(self, header: str | None) -> str | None:
        """None: no credentials; "": wrong ones; else the user."""
        if not header or not header.startswith("Basic "):
            return None
        try:
            name, _, password = base64.b64decode(header[6:]).decode().partition(":")
        except ValueError:
            return ""
        return name if self.users.get(name) == password else ""

    def _grant(self, user: str | None, service: str, scope: str) -> tuple[int, bytes]:
        if user == "":
            return 401, b'{"details": "invalid credentials"}'
        access = []
        for item in scope.split():
            kind, _, rest = item.partition(":")
            name, _, actions = rest.rpartition(":")
            if kind != "repository":
                continue
            allowed = set()
            if name in self.public or (user and name in self.readable.get(user, set())):
                allowed.add("pull")
            if user == "admin":
                allowed |= {"pull", "push"}
            granted = [a for a in actions.split(",") if a in allowed]
            access.append({"type": "repository", "name": name, "actions": granted})
        return 200, json.dumps(
            {"token": self.sign(user or "", service, access), "expires_in": 300}
        ).encode()

    def sign(self, subject: str, audience: str, access: list[dict[str, Any]]) -> str:
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "kid": self._kid}
        claims = {
            "iss": TOKEN_ISSUER,
            "sub": subject,
            "aud": audience,
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": secrets.token_hex(8),
            "access": access,
        }
        signing_input = (
            f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        )
        signature = subprocess.run(
            ["openssl", "dgst", "-sha256", "-sign", str(self.key)],
            input=signing_input.encode(),
            check=True,
            capture_output=True,
        ).stdout
        return f"{signing_input}.{_b64url(signature)}"


# --- the registry ------------------------------------------------------------------------
@dataclass(frozen=True)
class Served:
    """One request the registry answered, from its log."""

    method: str
    uri: str
    status: int


@dataclass
class RegistryServer:
    """`docker-registry serve` on 127.0.0.1:<free port>, storage under `base`."""

    base: Path
    auth: AuthMode = "none"
    users: dict[str, str] = field(default_factory=dict)
    token_server: TokenServer | None = None
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    _log_mark: int = 0

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    @property
    def storage(self) -> Path:
        return self.base / "storage"

    @property
    def log_path(self) -> Path:
        return self.base / "registry.log"

    def _config(self) -> str:
        lines = [
            "version: 0.1",
            "log:",
            "  level: info",
            "  formatter: json",
            "  accesslog:",
            "    disabled: true",
            "storage:",
            "  filesystem:",
            f"    rootdirectory: {self.storage}",
            "  delete:",
            "    enabled: true",
            "http:",
            f"  addr: {self.host}",
        ]
        if self.auth == "basic":
            htpasswd = self.base / "htpasswd"
            htpasswd.write_text("".join(f"{u}:{bcrypt_hash(p)}\n" for u, p in self.users.items()))
            lines += ["auth:", "  htpasswd:", "    realm: cri-shim-test", f"    path: {htpasswd}"]
        elif self.auth == "token":
            assert self.token_server is not None
            lines += [
                "auth:",
                "  token:",
                f"    realm: {self.token_server.realm}",
                f"    service: {TOKEN_SERVICE}",
                f"    issuer: {TOKEN_ISSUER}",
                f"    rootcertbundle: {self.token_server.cert}",
            ]
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 15.0) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        if self.auth == "token" and self.token_server is None:
            self.token_server = TokenServer(self.base / "tokens", dict(self.users))
            self.token_server.readable = {u: set() for u in self.users}
        if self.token_server is not None and self.token_server.port == 0:
            self.token_server.users.setdefault("admin", "admin-secret")
            self.token_server.start()
        self.users.setdefault("admin", "admin-secret")
        config = self.base / "config.yml"
        deadline = time.monotonic() + timeout
        while True:
            self.port = free_port()
            config.write_text(self._config())
            log = self.log_path.open("ab")
            self.proc = subprocess.Popen(
                [REGISTRY_BINARY, "serve", str(config)], stdout=log, stderr=log
            )
            log.close()
            if self._wait_ready(deadline):
                return
            self._kill()  # the port was taken meanwhile: try another
            if time.monotonic() > deadline:
                raise TimeoutError(f"docker-registry did not start:\n{self.log_tail()}")

    def _wait_ready(self, deadline: float) -> bool:
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                response = httpx.get(f"{self.url}/v2/", timeout=1)
                if response.status_code in (200, 401):
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        return False

    def _kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        self._kill()
        if self.token_server is not None:
            self.token_server.stop()

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""

    # --- what it served ------------------------------------------------------------------
    def served(self, since_mark: bool = True) -> list[Served]:
        result = []
        lines = self.log_path.read_text(errors="replace").splitlines()
        for line in lines[self._log_mark if since_mark else 0 :]:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if not str(entry.get("msg", "")).startswith("response completed"):
                continue
            result.append(
                Served(
                    entry.get("http.request.method", ""),
                    entry.get("http.request.uri", ""),
                    int(entry.get("http.response.status", 0)),
                )
            )
        return result

    def mark(self) -> None:
        """Count from here on (after pushes): from the log line of a request of the mark's
        own, which the registry writes once it has logged the requests answered before."""
        uri = f"/v2/?mark={secrets.token_hex(8)}"
        httpx.get(f"{self.url}{uri}", timeout=30)

        def marked() -> int:
            lines = self.log_path.read_text(errors="replace").splitlines()
            for number, line in enumerate(lines, 1):
                if uri in line and "response completed" in line:
                    return number
            return 0

        self._log_mark = wait_until(marked, timeout=30)

    def blob_gets(self, digest: str | None = None) -> list[str]:
        """Blob bodies served (GET 200) since the mark: their digests."""
        found = []
        for entry in self.served():
            if entry.method == "GET" and entry.status == 200 and "/blobs/sha256:" in entry.uri:
                blob = entry.uri.rsplit("/", 1)[1]
                if digest is None or blob == digest:
                    found.append(blob)
        return found

    def manifest_gets(self) -> list[str]:
        return [
            e.uri.rsplit("/", 1)[1]
            for e in self.served()
            if e.method == "GET" and e.status == 200 and "/manifests/" in e.uri
        ]

    def blob_file(self, digest: str) -> Path:
        hex_part = digest.removeprefix("sha256:")
        return (
            self.storage
            / "docker"
            / "registry"
            / "v2"
            / "blobs"
            / "sha256"
            / hex_part[:2]
            / hex_part
            / "data"
        )

    def corrupt_blob(self, digest: str) -> None:
        """Flip bytes in the stored blob, keeping its size: the registry serves it as is."""
        path = self.blob_file(digest)
        data = bytearray(path.read_bytes())
        for offset in (len(data) // 3, len(data) // 2, len(data) - 20):
            data[offset] ^= 0xFF
        path.write_bytes(bytes(data))

    # --- pushing -------------------------------------------------------------------------
    def pusher(self) -> Pusher:
        return Pusher(self.url, ("admin", self.users.get("admin", "admin-secret")))

    def push(self, repository: str, image: BuiltImage, tag: str | None = "latest") -> str:
        with self.pusher() as pusher:
            return pusher.push_image(repository, image, tag)

    def push_index(
        self,
        repository: str,
        images: Iterable[tuple[BuiltImage, dict[str, str]]],
        tag: str = "latest",
        media_type: str = OCI_INDEX,
    ) -> str:
        with self.pusher() as pusher:
            return pusher.push_index(repository, list(images), tag, media_type)


class Pusher:
    """Monolithic blob upload (POST, then PUT with the digest) and manifest PUT, answering
    basic or bearer challenges with the admin's credentials."""

    def __init__(self, url: str, admin: tuple[str, str]) -> None:
        self.url = url
        self.admin = admin
        self.client = httpx.Client(timeout=60)
        self._authorization: str | None = None

    def __enter__(self) -> Pusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        for _attempt in range(2):
            headers = dict(kwargs.pop("headers", {}) or {})
            if self._authorization:
                headers["Authorization"] = self._authorization
            response = self.client.request(method, url, headers=headers, **kwargs)
            kwargs["headers"] = {k: v for k, v in headers.items() if k != "Authorization"}
            if response.status_code != 401:
                return response
            self._authorize(response.headers.get("www-authenticate", ""))
        return response

    def _authorize(self, challenge: str) -> None:
        if challenge.startswith("Basic"):
            pair = f"{self.admin[0]}:{self.admin[1]}".encode()
            self._authorization = "Basic " + base64.b64encode(pair).decode()
            return
        params = dict(part.split("=", 1) for part in challenge.removeprefix("Bearer ").split(","))
        params = {k: v.strip('"') for k, v in params.items()}
        scope = params.get("scope", "")
        if scope.endswith(":pull"):
            scope += ",push"
        response = httpx.get(
            params["realm"],
            params={"service": params.get("service", ""), "scope": scope},
            auth=self.admin,
            timeout=30,
        )
        response.raise_for_status()
        self._authorization = f"Bearer {response.json()['token']}"

    def push_blob(self, repository: str, data: bytes, digest: str | None = None) -> str:
        digest = digest or digest_of(data)
        head = self._request("HEAD", f"{self.url}/v2/{repository}/blobs/{digest}")
        if head.status_code == 200:
            return digest
        started = self._request("POST", f"{self.url}/v2/{repository}/blobs/uploads/")
        if started.status_code != 202:
            raise RuntimeError(
                f"upload of {digest} not started: {started.status_code} {started.text}"
            )
        location = httpx.URL(self.url).join(started.headers["location"])
        location = location.copy_merge_params({"digest": digest})
        done = self._request(
            "PUT",
            str(location),
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )
        if done.status_code != 201:
            raise RuntimeError(f"upload of {digest} failed: {done.status_code} {done.text}")
        return digest

    def push_manifest(self, repository: str, reference: str, data: bytes, media_type: str) -> str:
        response = self._request(
            "PUT",
            f"{self.url}/v2/{repository}/manifests/{reference}",
            content=data,
            headers={"Content-Type": media_type},
        )
        if response.status_code != 201:
            raise RuntimeError(
                f"manifest {repository}:{reference}: {response.status_code} {response.text}"
            )
        return digest_of(data)

    def push_image(self, repository: str, image: BuiltImage, tag: str | None = "latest") -> str:
        """Push `image` (layers, config, manifest) as `repository:tag` (or by digest only
        when `tag` is None); returns the manifest digest."""
        for layer in image.layers:
            self.push_blob(repository, layer.data, layer.digest)
        self.push_blob(repository, image.config, image.config_digest)
        reference = tag or image.manifest_digest
        return self.push_manifest(repository, reference, image.manifest, image.manifest_media_type)

    def push_index(
        self,
        repository: str,
        images: list[tuple[BuiltImage, dict[str, str]]],
        tag: str,
        media_type: str = OCI_INDEX,
    ) -> str:
        """Push each image by digest, then an index of them (with the platforms given as
        {"os", "architecture", "variant"?}) as `repository:tag`; returns its digest."""
        entries = []
        for image, platform in images:
            self.push_image(repository, image, None)
            entries.append(_index_entry(image, platform))
        index = {"schemaVersion": 2, "mediaType": media_type, "manifests": entries}
        data = json.dumps(index, sort_keys=True).encode()
        return self.push_manifest(repository, tag, data, media_type)


def _index_entry(image: BuiltImage, platform: dict[str, str]) -> dict[str, object]:
    """An image's entry in an image index (the manifest by digest, with its platform)."""
    return {
        "mediaType": image.manifest_media_type,
        "digest": image.manifest_digest,
        "size": len(image.manifest),
        "platform": platform,
    }


def start_registry(
    base: Path, auth: AuthMode = "none", users: dict[str, str] | None = None
) -> RegistryServer:
    registry = RegistryServer(base, auth, dict(users or {}))
    registry.start()
    return registry


@dataclass
class TrickleProxy:
    """A plain-HTTP proxy in front of a registry that sends the body of every blob larger
    than `min_size` one byte every `interval` seconds: a registry that keeps a download
    alive without ever letting a read time out. `trickling` is set at the first such body;
    `trickled` lists the paths of those bodies, in the order they started."""

    upstream: str
    interval: float = 0.5
    min_size: int = 4096
    port: int = 0
    trickling: threading.Event = field(default_factory=threading.Event)
    trickled: list[str] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                skip = ("host", "connection", "accept-encoding")
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                upstream = httpx.get(proxy.upstream + self.path, headers=headers, timeout=30)
                data = upstream.content
                self.send_response(upstream.status_code)
                for key, value in upstream.headers.items():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                slow = "/blobs/" in self.path and len(data) > proxy.min_size
                try:
                    if not slow:
                        self.wfile.write(data)
                        return
                    proxy.trickled.append(self.path)
                    proxy.trickling.set()
                    for index in range(len(data)):
                        self.wfile.write(data[index : index + 1])
                        self.wfile.flush()
                        time.sleep(proxy.interval)
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client gave up, as it should

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


# --- an in-memory fake, for unit tests ---------------------------------------------------
@dataclass
class FakeRegistry:
    """Registry API v2 in memory, served through `httpx.MockTransport`: manifests and
    blobs per repository, optional basic or bearer auth (its token realm is
    `https://auth.<host>/token`), a log of requests, and hooks to fail or slow a path."""

    host: str
    auth: AuthMode = "none"
    users: dict[str, str] = field(default_factory=dict)
    manifests: dict[tuple[str, str], tuple[str, bytes]] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    delay: float = 0.0
    down: bool = False
    fail: Callable[[httpx.Request], httpx.Response | None] | None = None

    @property
    def realm(self) -> str:
        return f"https://auth.{self.host}/token"

    def put_image(self, repository: str, image: BuiltImage, tag: str | None = "latest") -> str:
        for layer in image.layers:
            self.blobs[layer.digest] = layer.data
        self.blobs[image.config_digest] = image.config
        entry = (image.manifest_media_type, image.manifest)
        self.manifests[(repository, image.manifest_digest)] = entry
        if tag:
            self.manifests[(repository, tag)] = entry
        return image.manifest_digest

    def put_index(
        self,
        repository: str,
        images: list[tuple[BuiltImage, dict[str, str]]],
        tag: str,
        media_type: str = OCI_INDEX,
    ) -> str:
        entries = []
        for image, platform in images:
            self.put_image(repository, image, None)
            entries.append(_index_entry(image, platform))
        data = json.dumps(
            {"schemaVersion": 2, "mediaType": media_type, "manifests": entries}
        ).encode()
        digest = digest_of(data)
        self.manifests[(repository, tag)] = (media_type, data)
        self.manifests[(repository, digest)] = (media_type, data)
        return digest

    def gets(self, kind: str = "blobs") -> list[str]:
        return [r.rsplit("/", 1)[1] for r in self.requests if f"/{kind}/" in r]

    def _authorized(self, request: httpx.Request) -> bool:
        header = str(request.headers.get("authorization", ""))
        if self.auth == "basic":
            try:
                name, _, password = (
                    base64.b64decode(header.removeprefix("Basic ")).decode().partition(":")
                )
            except ValueError:
                return False
            return header.startswith("Basic ") and bool(self.users.get(name) == password)
        if self.auth == "token":
            return header.startswith("Bearer tok-")
        return True

    def _token(self, request: httpx.Request) -> httpx.Response:
        header = request.headers.get("authorization", "")
        if header:
            name, _, password = (
                base64.b64decode(header.removeprefix("Basic ")).decode().partition(":")
            )
            if self.users.get(name) != password:
                return httpx.Response(401, json={"details": "bad credentials"})
            return httpx.Response(200, json={"token": f"tok-{name}", "expires_in": 300})
        if request.method == "POST":
            form = parse_qs(request.content.decode())
            if form.get("refresh_token") == ["refresh-ok"]:
                return httpx.Response(200, json={"access_token": "tok-refreshed"})
            return httpx.Response(401, json={"details": "bad refresh token"})
        return httpx.Response(200, json={"token": "anonymous-token"})

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == f"auth.{self.host}".split(":")[0] or request.url.path == "/token":
            self.requests.append(f"{request.method} token")
            return self._token(request)
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        self.requests.append(f"{request.method} {request.url.path}")
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail is not None and (failed := self.fail(request)) is not None:
            return failed
        if not self._authorized(request):
            repository = request.url.path.removeprefix("/v2/").rsplit("/", 2)[0]
            challenge = (
                'Basic realm="fake"'
                if self.auth == "basic"
                else f'Bearer realm="{self.realm}",service="fake",'
                f'scope="repository:{repository}:pull"'
            )
            return httpx.Response(
                401,
                headers={"WWW-Authenticate": challenge},
                json={"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]},
            )
        path = request.url.path.removeprefix("/v2/")
        if "/manifests/" in path:
            repository, _, reference = path.rpartition("/manifests/")
            found = self.manifests.get((repository, reference))
            if found is None:
                return httpx.Response(
                    404,
                    json={"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]},
                )
            return httpx.Response(200, content=found[1], headers={"Content-Type": found[0]})
        if "/blobs/" in path:
            digest = path.rpartition("/blobs/")[2]
            data = self.blobs.get(digest)
            if data is None:
                return httpx.Response(
                    404, json={"errors": [{"code": "BLOB_UNKNOWN", "message": "blob unknown"}]}
                )
            return httpx.Response(200, content=data)
        return httpx.Response(404)


def fake_transport(*registries: FakeRegistry) -> httpx.MockTransport:
    """Routes each request to the fake whose host (or token host) it names; any other
    host is refused, as an unreachable one would be."""
    by_host = {}
    for registry in registries:
        by_host[registry.host] = registry
        by_host[f"auth.{registry.host}".split(":")[0]] = registry

    async def handler(request: httpx.Request) -> httpx.Response:
        netloc = request.url.netloc.decode()
        registry = by_host.get(netloc) or by_host.get(request.url.host)
        if registry is None:
            raise httpx.ConnectError(f"cannot connect to {netloc}", request=request)
        return await registry.handle(request)

    return httpx.MockTransport(handler)
