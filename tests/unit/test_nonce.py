"""Sale nonces: random, never repeated within a process nor across a fork."""

from __future__ import annotations

import os

from capsvc.redis.store import nonce


def test_nonces_do_not_repeat_and_a_forked_child_draws_its_own() -> None:
    seen = {nonce() for _ in range(2000)}  # past one buffer of 512
    assert len(seen) == 2000
    assert all(len(n) == 8 for n in seen)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next nonces, to the parent
        os.close(read)
        os.write(write, b"".join(nonce() for _ in range(100)))
        os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 4096):
        data += chunk
    os.waitpid(pid, 0)
    child = {data[i:i + 8] for i in range(0, len(data), 8)}
    mine = {nonce() for _ in range(100)}
    assert len(child) == 100
    assert not child & mine
