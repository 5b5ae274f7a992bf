"""A process out of file descriptors (EMFILE) cannot accept a connection: waitress retried at
once and logged a traceback each time, thousands a second into the job's log. The server says so
once, pauses its accepts, says when it accepts again, and serves the connection that waited."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from lightkeeper.processes import stop_process, wait_until

OUT_OF_FDS = textwrap.dedent("""
    import os, resource, sys
    from http_serving import BackgroundWSGIServer

    def hello(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"hello"]

    server = BackgroundWSGIServer(hello).start()
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    hog = []
    try:
        while True:
            hog.append(open(os.devnull))
    except OSError:
        pass
    print(server.url, flush=True)
    sys.stdin.readline()
    for f in hog:
        f.close()
    print("freed", flush=True)
    sys.stdin.readline()
    server.stop()
""")


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_NOFILE as on Linux")
def test_out_of_file_descriptors_is_said_once_and_served_after(tmp_path: Path):
    err = tmp_path / "err"
    repo = Path(__file__).resolve().parents[1]
    with open(err, "wb") as err_file:
        proc = subprocess.Popen([sys.executable, "-c", OUT_OF_FDS], cwd=repo,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err_file,
                                text=True)
    try:
        url = urlsplit(proc.stdout.readline().strip())
        client = socket.create_connection((url.hostname, url.port), timeout=10)
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        wait_until(lambda: err.read_text().strip(), 10, what="the server to say it")
        client.settimeout(1.0)  # waits unaccepted while the fds are gone
        with pytest.raises(TimeoutError):
            client.recv(1)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "freed"
        client.settimeout(10)
        answer = b""
        while chunk := client.recv(4096):
            answer += chunk
        client.close()
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"hello"), answer
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=10) == 0
    finally:
        stop_process(proc, grace=0)
    lines = err.read_text().splitlines()
    assert len(lines) == 2, f"{len(lines)} lines: {lines[:5]}"
    assert "cannot accept connections (Too many open files)" in lines[0]
    assert "accepting connections again" in lines[1]
