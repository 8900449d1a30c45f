"""Helpers the bench/ drivers share: ephemeral ports and waiting on a condition with a deadline."""

import socket
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(what, cond, timeout=30.0):
    """Polls `cond` every 50 ms (OSError counts as not yet) until true; exits after `timeout`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if cond():
                return
        except OSError:
            pass
        time.sleep(0.05)
    sys.exit(f"bench: timed out waiting for {what}")
