"""The reshard job on Ray: `ray job submit` against a real head node, and faults on the session Ray.

The head (``ray start --head --block`` on 127.0.0.1, free ports, its own ``--temp-dir``) is a
child process of this module's fixture; the test process never connects to it with
``ray.init``: ``ray job submit`` runs as a subprocess with ``RAY_ADDRESS`` set to the head's
dashboard. Teardown ends only that head: SIGTERM to its ``ray start`` process (which takes its
Ray processes down with it), then whatever is left in its process group or names its temp dir.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

import raydcp
from raydcp.errors import CheckpointError
from raydcp.reshard import ReshardOptions, ThreadExecutor, reshard_with
from tests.reshard.test_reshard import assert_resharded

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
EXCLUDES = [".venv", ".git", "bench/results", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _our_pids(marker: str) -> list[int]:
    """Processes whose command line names ``marker`` (the head's own temp dir)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        out.append(int(entry))
            except OSError:
                pass
    return out


@pytest.fixture(scope="module")
def head():
    """A Ray head on loopback with the dashboard (job submission); yields the env to reach it."""
    temp = tempfile.mkdtemp(prefix="rdcp-head-", dir="/tmp")  # short: Ray's socket paths must fit 107 chars
    (gcs, dash, client, agent_http, agent_grpc, rt_env, metrics, node_mgr, obj_mgr) = _free_ports(9)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    for var in ("RAY_ADDRESS", "PYTHONPATH"):
        env.pop(var, None)
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--num-cpus=2", "--num-gpus=0", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
           f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--runtime-env-agent-port={rt_env}", f"--metrics-export-port={metrics}",
           f"--node-manager-port={node_mgr}", f"--object-manager-port={obj_mgr}",
           "--object-store-memory=200000000", f"--temp-dir={temp}", "--disable-usage-stats"]
    log = open(os.path.join(temp, "ray-start.log"), "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ray start exited with {proc.returncode}: {Path(temp, 'ray-start.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/version", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the head's dashboard did not come up within 180 s")
            time.sleep(1)
        yield {**env, "RAY_ADDRESS": url}
    finally:
        if proc.poll() is None:  # `ray start --block` stops its processes on SIGTERM; the rest are killed below
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for target in (lambda: os.killpg(proc.pid, signal.SIGKILL),
                       *[(lambda p=p: os.kill(p, signal.SIGKILL)) for p in _our_pids(temp)]):
            try:
                target()
            except OSError:
                pass
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def submit(env: dict, *job_args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    runtime_env = json.dumps({"excludes": EXCLUDES})
    cmd = [str(BIN / "ray"), "job", "submit", "--working-dir", str(REPO), "--runtime-env-json", runtime_env,
           "--", "python", "jobs/reshard.py", *job_args]
    return subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=timeout)


@pytest.mark.ray
@pytest.mark.own_ray
def test_ray_job_submit_reshards_bit_exact_and_reruns_as_noop(head, src, full, tmp_path):
    dst = str(tmp_path / "dst")
    args = (src, dst, "--world-size", "3", "--memory-budget", "400", "--num-cpus-per-actor", "0.5", "--json")
    proc = submit(head, *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "succeeded" in out, out[-4000:]
    # the job ran in rounds, and said so
    assert "round 1/" in out and "committed" in out, out[-4000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"src"')))
    assert result["rounds"] > 1 and not result["noop"] and len(result["peak_rss_per_actor"]) == 3
    assert_resharded(dst, full, ReshardOptions(world_size=3, memory_budget=400))
    # the rerun finds DST done and starts no actor
    again = submit(head, *args)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert "nothing to do" in again.stdout, again.stdout[-4000:]


def test_job_errors_are_one_line_and_need_no_ray(tmp_path, capsys):
    from raydcp.runtime.shard_group.reshard_job import main

    assert main([str(tmp_path / "missing"), str(tmp_path / "dst"), "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raydcp reshard: error: no committed raydcp checkpoint") and err.count("\n") == 1
    assert main([str(tmp_path / "missing"), str(tmp_path / "dst"), "-M", "2", "--dtype", "int8"]) == 2
    assert "not a floating dtype" in capsys.readouterr().err


# ------------------------------------------------------------- faults, on the session's Ray

@pytest.mark.ray
def test_dead_actor_fails_the_round_fast_and_rerun_resumes(ray_session, src, full, tmp_path):
    from raydcp.runtime.shard_group.reshard_job import RayExecutor

    dst = str(tmp_path / "dst")
    options = ReshardOptions(world_size=3, layout="dim1", memory_budget=128)
    executors: list[RayExecutor] = []

    def make() -> RayExecutor:
        executors.append(RayExecutor(3, num_gpus_per_actor=0.05, num_cpus_per_actor=0, timeout_s=60))
        return executors[-1]

    killed_at: list[float] = []

    def kill_after_round_two(msg: str) -> None:
        if msg.startswith("round 2/"):
            ray_session.kill(executors[0].group.actors[1], no_restart=True)
            killed_at.append(time.monotonic())

    with pytest.raises(CheckpointError, match=r"round 3 failed .*ranks \[1\] died.*rerun the job"):
        reshard_with(make, RayExecutor.per_process, src, dst, options, log=kill_after_round_two)
    assert time.monotonic() - killed_at[0] < 45  # not the 60 s timeout: a dead actor fails the round at once
    assert not os.path.exists(os.path.join(dst, "raydcp.meta"))
    # the rerun resumes from the journal the actors wrote (here with threads: the same plan)
    result = reshard_with(lambda: ThreadExecutor(3, timeout_s=60), RayExecutor.per_process, src, dst, options)
    assert result.resumed_rounds == 2 and result.rounds > 2
    assert_resharded(dst, full, options)
    assert raydcp.read_metadata(dst).extra["reshard"]["options"]["layout"] == "dim1"
