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


def get(url):
    """GET `url` (2 s timeout): (status, body text)."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status, r.read().decode()


class Stack:
    """The processes of one benchmark run (simulated fleet, kvepp, Envoy), their logs in `work`,
    stopped together by `stop()`, which also removes `work`."""

    def __init__(self, prefix):
        import tempfile

        self.work = tempfile.mkdtemp(prefix=prefix)
        self.procs = []

    def spawn(self, cmd, log):
        import os
        import subprocess

        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.work, log), "w"),
                             stdin=subprocess.DEVNULL)
        self.procs.append(p)
        return p

    def fleet(self, sim, engines, params):
        """`kvepp-sim fleet` with its default parameters overridden by `params`; returns the
        manifests directory it writes the pool into, once written."""
        import os
        import subprocess

        import yaml

        mdir = os.path.join(self.work, "manifests")
        p = yaml.safe_load(subprocess.run([sim, "fleet", "--print-params"], check=True,
                                          capture_output=True, text=True).stdout)
        p.update(params)
        path = os.path.join(self.work, "params.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(p, f)
        self.spawn([sim, "fleet", "--engines", str(engines), "--params", path, "--manifests-dir", mdir],
                   "fleet.log")
        wait("the simulated fleet", lambda: os.path.exists(os.path.join(mdir, "pool.yaml")))
        return mdir

    def kvepp(self, kvepp, config, mdir):
        """`kvepp serve` for `sim-pool` on ephemeral loopback ports, once ready: (process, ext_proc
        port, metrics base URL)."""
        grpc, health, metrics = free_port(), free_port(), free_port()
        p = self.spawn(
            [kvepp, "serve", "--config", config, "--pool-name", "sim-pool", "--manifests-dir", mdir,
             "--bind-address", "127.0.0.1", "--grpc-port", str(grpc), "--grpc-health-port", str(health),
             "--metrics-port", str(metrics), "--log-level", "warn"],
            "kvepp.log",
        )
        url = f"http://127.0.0.1:{metrics}"
        wait("kvepp ready", lambda: get(url + "/ready")[0] == 200)
        return p, grpc, url

    def envoy(self, envoy, bootstrap):
        """Envoy on `bootstrap` (a dict) with ephemeral listener and admin ports, once ready; returns
        the listener port."""
        import os

        import yaml

        listen, admin = free_port(), free_port()
        bootstrap["admin"]["address"]["socket_address"]["port_value"] = admin
        bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = listen
        cfg = os.path.join(self.work, "envoy.yaml")
        with open(cfg, "w") as f:
            yaml.safe_dump(bootstrap, f)
        self.spawn([envoy, "-c", cfg, "--concurrency", "1", "--use-dynamic-base-id", "-l", "warning"],
                   "envoy.log")
        wait("Envoy", lambda: get(f"http://127.0.0.1:{admin}/ready")[0] == 200)
        return listen

    def stop(self):
        import subprocess

        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        import shutil

        shutil.rmtree(self.work, ignore_errors=True)
