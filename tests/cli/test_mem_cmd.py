"""`raydcp mem ls|rm|usage|stop`: the memory tier from the command line.

In-process (raydcp.cli.main) against the session's Ray instance for the output of each
subcommand; the installed console script connecting to the session's cluster by its address, and
to an unreachable one, which must fail within `--timeout` with one line naming the address (exit
status 2), where Ray alone retries for minutes.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import uuid

import pytest
import torch

import raydcp
from raydcp.cli import main

SCRIPT = os.path.join(os.path.dirname(sys.executable), "raydcp")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def name(ray_session):
    import fsspec

    name = f"cli-{uuid.uuid4().hex[:8]}"
    yield name
    fsspec.filesystem("raymem").rm(name, recursive=True)


def test_ls_usage_and_rm_of_a_name(name, capsys):
    raydcp.save({"w": torch.ones(64), "step": 3}, f"raymem://{name}/step-3")
    code, out, err = _run(capsys, "mem", "ls", "--json")
    assert code == 0, err
    rows = [r for r in json.loads(out)["checkpoints"] if r["name"] == name]
    assert [(r["url"], r["step"]) for r in rows] == [(f"raymem://{name}/step-3", 3)]
    assert rows[0]["committed_at"] is not None and rows[0]["bytes"] > 64 * 4

    code, out, _ = _run(capsys, "mem", "ls", name)
    assert code == 0 and f"raymem://{name}: 1 checkpoint under 1 NAME" in out and f"raymem://{name}/step-3" in out

    code, out, err = _run(capsys, "mem", "usage", "--json")
    assert code == 0, err
    import ray

    here = {n["node"]: n for n in json.loads(out)["nodes"]}[ray.get_runtime_context().get_node_id()]
    assert here["state"] == "running" and here["held"] >= rows[0]["bytes"]
    code, out, _ = _run(capsys, "mem", "usage")
    assert code == 0 and "held" in out and "reserved" in out and "total" in out

    code, out, err = _run(capsys, "mem", "rm", f"raymem://{name}")
    assert code == 0, err
    assert f"removed raymem://{name} (" in out and f"committed checkpoints: raymem://{name}/step-3" in out
    code, out, err = _run(capsys, "mem", "rm", f"raymem://{name}")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and f"raymem://{name}: nothing is held there" in err
    code, out, _ = _run(capsys, "mem", "ls", name)
    assert code == 0 and f"raymem://{name}: no checkpoints held in memory" in out


def test_stop_refused_while_checkpoints_are_held(name, capsys):
    raydcp.save({"w": torch.ones(8)}, f"raymem://{name}/a")
    code, out, err = _run(capsys, "mem", "stop")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"raymem://{name}/a (committed)" in err and "--force" in err
    code, out, _ = _run(capsys, "mem", "ls", name, "--json")
    assert [r["url"] for r in json.loads(out)["checkpoints"]] == [f"raymem://{name}/a"]  # still held


def _script(argv: list[str], ray_address: str | None = None) -> subprocess.CompletedProcess:
    assert os.path.exists(SCRIPT), "raydcp is not installed in this environment (pip install -e .)"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    # the hang guard: Ray's own connection retries last minutes
    return subprocess.run([SCRIPT, *argv], capture_output=True, text=True, timeout=240, env=env)


def test_the_console_script_connects_to_the_cluster_at_its_address(name):
    import ray

    raydcp.save({"w": torch.ones(8), "step": 11}, f"raymem://{name}/a")
    proc = _script(["mem", "ls", name, "--json", "--address", ray.get_runtime_context().gcs_address])
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["checkpoints"]
    assert [(r["url"], r["step"]) for r in rows] == [(f"raymem://{name}/a", 11)]


def test_an_address_where_nothing_listens_fails_with_one_line_naming_it():
    proc = _script(["mem", "ls", "--timeout", "5"], ray_address="127.0.0.1:1")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("raydcp: error: no Ray cluster reachable at 127.0.0.1:1 within 5s")
    assert "connection refused" in proc.stderr and "Traceback" not in proc.stderr


def test_an_address_that_accepts_but_is_no_ray_cluster_fails_within_the_timeout():
    server = socket.create_server(("0.0.0.0", 0))
    port = server.getsockname()[1]
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:  # takes connections and never answers
        server.settimeout(0.5)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        proc = _script(["mem", "usage", "--address", f"127.0.0.1:{port}", "--timeout", "3"])
    finally:
        stop.set()
        thread.join()
        for c in accepted:
            c.close()
        server.close()
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    last = proc.stderr.strip().splitlines()[-1]  # Ray itself may log a retry above it
    assert last.startswith(f"raydcp: error: no Ray cluster reachable at 127.0.0.1:{port} within 3s"), proc.stderr
    assert "no Ray cluster answered" in last and "Traceback" not in proc.stderr
