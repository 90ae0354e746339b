"""How raydcp joins a Ray cluster for ``raymem://`` paths, in processes of their own.

Each test runs a short Python program in a subprocess with a Ray instance of its own (or none):
the session's Ray instance of this test process is never shut down or reconnected here.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parents[2])
_CLI = [sys.executable, "-c", "import sys; from raydcp.cli import main; sys.exit(main())"]
_GUARD_S = 300  # a hang guard for the subprocess, never a speed limit


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return {**env, **extra}


def _closed_port() -> int:
    """A loopback port with nothing listening on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=_GUARD_S)


@pytest.mark.parametrize("command", [
    ["inspect", "raymem://nowhere/ckpt"],
    ["verify", "raymem://nowhere/ckpt"],
    ["ls", "raymem://nowhere"],
])
def test_an_unreachable_cluster_address_fails_at_once_naming_it(command):
    address = f"127.0.0.1:{_closed_port()}"
    done = _run([*_CLI, *command], _env(RAY_ADDRESS=address))
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "Traceback" not in out, out[-3000:]
    assert address in out and "RAY_ADDRESS" in out and "does not answer" in out, out[-3000:]


def test_load_and_save_to_an_unreachable_cluster_raise_a_checkpoint_error_naming_it():
    address = f"127.0.0.1:{_closed_port()}"
    program = textwrap.dedent(f"""
        import torch, raydcp
        for call in (lambda: raydcp.save({{"w": torch.ones(2)}}, "raymem://nowhere/a"),
                     lambda: raydcp.load({{"w": torch.ones(2)}}, "raymem://nowhere/a")):
            try:
                call()
            except raydcp.CheckpointError as exc:
                assert {address!r} in str(exc), str(exc)
            else:
                raise SystemExit("no error")
        print("ok")
    """)
    done = _run([sys.executable, "-c", program], _env(RAY_ADDRESS=address))
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.stdout + done.stderr)[-3000:]


def test_raydcp_leaves_the_environment_as_it_was_and_works_after_a_new_ray_init():
    """A save to raymem:// connects nothing process-wide: after ``ray.shutdown()``, a plain
    ``ray.init(num_cpus=...)`` starts a new instance (RAY_ADDRESS left set would point it at the
    old one), and raymem:// saves and loads in it (no handle of the old session is reused)."""
    program = textwrap.dedent("""
        import logging, os
        import ray, torch, raydcp

        opts = dict(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR,
                    object_store_memory=100 * 1024 * 1024)
        for attempt in range(2):
            ray.init(**opts)
            before = dict(os.environ)  # as ray.init left it
            w = torch.arange(64, dtype=torch.float32) + attempt
            raydcp.save({"w": w, "attempt": attempt}, "raymem://conn/ckpt")
            back = {"w": torch.zeros(64), "attempt": -1}
            raydcp.load(back, "raymem://conn/ckpt")
            assert torch.equal(back["w"], w) and back["attempt"] == attempt
            future = raydcp.async_save({"w": w * 2}, "raymem://conn/async")  # a helper process writes it
            future.result(timeout=240)
            back = {"w": torch.zeros(64)}
            raydcp.load(back, "raymem://conn/async")
            assert torch.equal(back["w"], w * 2)
            changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}
            assert not changed, f"raydcp changed the environment: {sorted(changed)}"
            ray.shutdown()
        print("ok")
    """)
    # RAY_ADDRESS=local: each ray.init starts an instance of its own even where another runs on this
    # machine (a test suite's); raydcp setting RAY_ADDRESS would show as a changed environment
    done = _run([sys.executable, "-c", program], _env(RAY_ADDRESS="local"))
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.stdout + done.stderr)[-4000:]


def test_memory_checkpoints_load_and_save_after_a_reconnect_to_the_same_cluster():
    """``ray.shutdown()`` then ``ray.init()`` to the same cluster in one process: the detached
    holders kept the checkpoint, and raydcp finds them (and the coordinator host, and starts a new
    persister actor) again by name instead of using handles of the old session."""
    program = textwrap.dedent("""
        import logging, os
        import ray, torch, raydcp
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=2, include_dashboard=False,
                                                                    object_store_memory=100 * 1024 * 1024))
        opts = dict(address=cluster.address, log_to_driver=False, logging_level=logging.ERROR)

        def state(step):
            return {"w": torch.arange(512, dtype=torch.float32) * step, "step": step}

        def loaded(url, group=None):
            back = {"w": torch.zeros(512), "step": -1}
            raydcp.load(back, url, group=group)
            assert torch.equal(back["w"], state(back["step"])["w"])
            return back["step"]

        try:
            ray.init(**opts)
            url = "raymem://reconnect/ckpt"
            group = raydcp.Group("reconnect", 0, 1)
            raydcp.save(state(1), url)
            raydcp.async_save(state(2), url, group=group).result(timeout=240)  # this process's persister actor
            assert loaded(url) == 2
            env = dict(os.environ)
            ray.shutdown()
            ray.init(**opts)
            assert loaded(url) == 2  # held by the detached holders all along, found again by name
            raydcp.save(state(3), url)
            assert loaded(url, group=group) == 3
            raydcp.async_save(state(4), url, group=group).result(timeout=240)  # a persister of the new session
            assert loaded(url) == 4
            assert dict(os.environ) == env, "raydcp changed the environment"
        finally:
            ray.shutdown()
            cluster.shutdown()
        print("ok")
    """)
    done = _run([sys.executable, "-c", program], _env())
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.stdout + done.stderr)[-4000:]
