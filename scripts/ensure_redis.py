"""Make sure a Redis server answers, then run a command with KVGATE_REDIS_URL set.

Order: $KVGATE_REDIS_URL if it answers, then redis://127.0.0.1:6379, else a
`redis-server` started here on a free port (no persistence, data under .redis-test/;
installed from Debian's packages first when the binary is missing and we are root).
Used by `make test`; standard library only, so it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

DEFAULT_URL = "redis://127.0.0.1:6379"
STATE_DIR = Path(".redis-test")


def answers(url: str, timeout: float = 1.0) -> bool:
    """True if a Redis server at `url` replies +PONG to PING."""
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379), timeout) as conn:
            conn.sendall(b"*1\r\n$4\r\nPING\r\n")
            return conn.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("redis-server not found: installing it from Debian's packages", file=sys.stderr)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], check=True, env=env)
        found = shutil.which("redis-server")
    if not found:
        sys.exit("no Redis server answers and redis-server is not installed")
    return found


def start_server() -> str:
    port = free_port()
    STATE_DIR.mkdir(exist_ok=True)
    subprocess.run(
        [
            redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--daemonize", "yes",
            "--dir", str(STATE_DIR.resolve()),
            "--pidfile", str((STATE_DIR / f"redis-{port}.pid").resolve()),
            "--logfile", str((STATE_DIR / f"redis-{port}.log").resolve()),
        ],
        check=True,
    )
    url = f"redis://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while not answers(url):
        if time.monotonic() > deadline:
            sys.exit(f"started redis-server on port {port} but it does not answer")
        time.sleep(0.05)
    print(f"started redis-server on {url}", file=sys.stderr)
    return url


def ensure() -> str:
    for url in (os.environ.get("KVGATE_REDIS_URL"), DEFAULT_URL):
        if url and answers(url):
            return url
    return start_server()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exec", nargs=argparse.REMAINDER, dest="command", help="command to run")
    args = parser.parse_args()
    url = ensure()
    if not args.command:
        print(url)
        return
    os.environ["KVGATE_REDIS_URL"] = url
    os.execvp(args.command[0], args.command)


if __name__ == "__main__":
    main()
