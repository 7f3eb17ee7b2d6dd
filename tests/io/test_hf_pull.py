"""`gemma4 pull` against a local HTTP server that speaks the hub's protocol for a synthetic repo:
API listing, HEAD with ETag, ranged GET (resume), redirects, auth failures, offline cache use."""

import hashlib
import http.server
import json
import os
import subprocess
import threading

import pytest

GEMMA4 = os.environ.get("GEMMA4_BIN", "build/gemma4")
SHA = "0123456789abcdef0123456789abcdef01234567"


def make_repo():
    weights = bytes((i * 7 + 3) % 256 for i in range(300_000))
    index = {"metadata": {"total_size": 2 * len(weights)},
             "weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    return {
        "config.json": b'{"model_type": "gemma4"}',
        "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00002.safetensors": weights,
        "model-00002-of-00002.safetensors": weights[::-1],
        "tokenizer.json": b"{}",
        "README.md": b"not a model file",
        "original/params.bin": b"not needed",
    }


class Hub:
    """A tiny hub: GET /api/models/<repo>/revision/<rev>, HEAD/GET /<repo>/resolve/<rev>/<file>.
    `cut_after` makes the first large GET drop the connection part-way (once)."""

    def __init__(self, repo_id, files, token=None, cut_after=None):
        self.repo_id, self.files, self.token, self.cut_after = repo_id, files, token, cut_after
        self.cut_done = set()
        self.range_requests = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def empty_response(self, status, headers=()):
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def authorized(self):
                if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    self.empty_response(401)
                    return False
                return True

            def resolve(self):
                prefix = f"/{hub.repo_id}/resolve/"
                if not self.path.startswith(prefix):
                    return None
                rev, _, name = self.path[len(prefix):].partition("/")
                return hub.files.get(name) if rev in ("main", SHA) else None

            def do_HEAD(self):
                if not self.authorized():
                    return
                data = self.resolve()
                if data is None:
                    self.empty_response(404)
                    return
                self.send_response(200)
                self.send_header("ETag", '"%s"' % hashlib.sha256(data).hexdigest())
                self.send_header("X-Repo-Commit", SHA)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()

            def do_GET(self):
                if not self.authorized():
                    return
                if self.path == f"/api/models/{hub.repo_id}/revision/main":
                    body = json.dumps({"sha": SHA, "siblings": [{"rfilename": n} for n in hub.files]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if self.path.startswith(f"/{hub.repo_id}/resolve/main/"):
                    # Like the hub for LFS files: redirect the branch name to the commit.
                    self.empty_response(302, [("Location", self.path.replace("/main/", f"/{SHA}/"))])
                    return
                data = self.resolve()
                if data is None:
                    self.empty_response(404)
                    return
                start = 0
                if "Range" in self.headers:
                    start = int(self.headers["Range"].split("=")[1].split("-")[0])
                    hub.range_requests.append(start)
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                name = self.path.rsplit("/", 1)[1]
                if hub.cut_after and len(body) > hub.cut_after and not hub.cut_done:
                    hub.cut_done.add(name)
                    self.wfile.write(body[:hub.cut_after])
                    self.wfile.flush()
                    self.connection.shutdown(2)
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def pull(args, cache, endpoint=None, **env_extra):
    env = dict(os.environ, HF_HUB_CACHE=str(cache), **env_extra)
    env.pop("HF_ENDPOINT", None)
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return subprocess.run([GEMMA4, "pull", "-q", *args], env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def repo():
    return make_repo()


def check_snapshot(path, files):
    assert os.path.basename(path) == SHA
    for name, data in files.items():
        if name in ("README.md", "original/params.bin"):
            assert not os.path.exists(os.path.join(path, name))
            continue
        link = os.path.join(path, name)
        assert os.path.islink(link), name
        with open(link, "rb") as f:
            assert f.read() == data, name


def test_download_into_hf_cache_layout(tmp_path, repo):
    hub = Hub("acme/tiny-model", repo)
    try:
        out = pull(["acme/tiny-model"], tmp_path, hub.url)
        assert out.returncode == 0, out.stderr
        path = out.stdout.strip()
        check_snapshot(path, repo)
        repo_dir = tmp_path / "models--acme--tiny-model"
        assert (repo_dir / "refs" / "main").read_text() == SHA
        etag = hashlib.sha256(repo["config.json"]).hexdigest()
        assert (repo_dir / "blobs" / etag).read_bytes() == repo["config.json"]
    finally:
        hub.close()
    # The cache alone now answers, with no endpoint and offline.
    out = pull(["acme/tiny-model"], tmp_path, None, HF_HUB_OFFLINE="1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == path


def test_interrupted_download_resumes(tmp_path, repo):
    hub = Hub("acme/tiny-model", repo, cut_after=100_000)
    try:
        first = pull(["acme/tiny-model"], tmp_path, hub.url)
        assert first.returncode != 0
        assert "resume" in first.stderr
        partial = list((tmp_path / "models--acme--tiny-model" / "blobs").glob("*.incomplete"))
        assert len(partial) == 1 and partial[0].stat().st_size == 100_000
        second = pull(["acme/tiny-model"], tmp_path, hub.url)
        assert second.returncode == 0, second.stderr
        assert 100_000 in hub.range_requests
        check_snapshot(second.stdout.strip(), repo)
    finally:
        hub.close()


def test_token_is_sent_and_required(tmp_path, repo):
    hub = Hub("acme/gated", repo, token="secret")
    try:
        denied = pull(["acme/gated"], tmp_path, hub.url)
        assert denied.returncode != 0 and "HF_TOKEN" in denied.stderr
        ok = pull(["acme/gated"], tmp_path, hub.url, HF_TOKEN="secret")
        assert ok.returncode == 0, ok.stderr
    finally:
        hub.close()


def test_single_gguf_file(tmp_path):
    files = {"model-Q4_0.gguf": b"GGUF" + bytes(5000), "model-Q8_0.gguf": b"GGUF" + bytes(9000)}
    hub = Hub("acme/tiny-gguf", files)
    try:
        out = pull(["acme/tiny-gguf/model-Q4_0.gguf"], tmp_path, hub.url)
        assert out.returncode == 0, out.stderr
        with open(out.stdout.strip(), "rb") as f:
            assert f.read() == files["model-Q4_0.gguf"]
        assert not list(tmp_path.rglob("model-Q8_0.gguf"))
    finally:
        hub.close()


def test_clear_errors(tmp_path, repo):
    out = pull(["acme/not-cached"], tmp_path, None)
    assert out.returncode == 1 and "HF_ENDPOINT" in out.stderr
    hub = Hub("acme/tiny-model", repo)
    try:
        missing = pull(["acme/other"], tmp_path, hub.url)
        assert missing.returncode == 1 and "not found" in missing.stderr
    finally:
        hub.close()
    bad = pull(["not a repo id"], tmp_path, None)
    assert bad.returncode == 1 and "neither a local path nor a repo id" in bad.stderr
