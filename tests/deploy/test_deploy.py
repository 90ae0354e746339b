"""Deployment files: cluster.yaml against Ray's own schema, the KubeRay manifests' structure, and
the job commands in them and in the README against the parsers they will meet."""
from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import pytest
import ray
import yaml

from raydcp.cli import build_parser as cli_parser
from raydcp.reshard.args import options_from_args
from raydcp.runtime.shard_group.reshard_job import build_parser as job_parser

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def parse_job_command(argv: list[str]):
    """``python .../jobs/reshard.py ARGS``: parsed with the job's own parser, options validated."""
    assert argv[0] == "python" and argv[1].endswith("jobs/reshard.py"), argv
    args = job_parser().parse_args(argv[2:])
    return args, options_from_args(args)


# ----------------------------------------------------------------------- Ray cluster launcher

def test_cluster_yaml_passes_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = load(REPO / "cluster.yaml")
    config = prepare_config(copy.deepcopy(raw))  # merged with the provider's defaults, as `ray up` does
    validate_config(config)                      # ray/autoscaler/ray-schema.json, offline


def test_cluster_yaml_has_a_head_and_autoscaling_gpu_workers_that_install_raydcp():
    c = load(REPO / "cluster.yaml")
    types = c["available_node_types"]
    assert c["head_node_type"] in types
    gpu = [t for name, t in types.items() if name != c["head_node_type"] and t["resources"].get("GPU", 0) > 0]
    assert gpu, "no GPU worker type"
    assert all(t["min_workers"] == 0 < t["max_workers"] <= c["max_workers"] for t in gpu)  # autoscaled from zero
    # the image carries this Ray version and Python 3.11
    assert c["docker"]["image"].startswith(f"rayproject/ray:{ray.__version__}-py311")
    # the checkout is synced (without .venv) and installed on every node
    assert c["file_mounts"]["~/raydcp"] == "." and ".venv" in c["rsync_exclude"]
    setup = "\n".join(c["setup_commands"])
    assert re.search(r"pip install .*-e \"\$HOME/raydcp\[s3\]\"", setup) and "import raydcp" in setup
    # token auth on every node
    assert all("RAY_AUTH_MODE=token" in cmd for cmd in c["head_start_ray_commands"][1:] + c["worker_start_ray_commands"][1:])


# ------------------------------------------------------------------------------------ KubeRay

def _containers(spec: dict) -> list[dict]:
    return spec["template"]["spec"]["containers"]


def check_ray_cluster_spec(spec: dict) -> list[dict]:
    """Required fields and sane values of a RayCluster spec; returns every container."""
    assert spec["rayVersion"] == ray.__version__
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())  # KubeRay wants strings
    containers = list(_containers(head))
    ports = {p["name"]: p["containerPort"] for p in containers[0].get("ports", [])}
    assert ports.get("dashboard") == 8265 and ports.get("gcs-server") == 6379
    workers = spec["workerGroupSpecs"]
    assert workers
    for group in workers:
        assert DNS_1123.match(group["groupName"])
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert isinstance(group["rayStartParams"], dict)
        cs = _containers(group)
        containers += cs
        limits = cs[0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) > 0 and limits == cs[0]["resources"]["requests"]
        assert group["minReplicas"] == 0 and group["maxReplicas"] > 0  # autoscaling GPU workers
    for c in containers:
        assert c["name"] and c["image"]
        env = {e["name"]: e for e in c.get("env", [])}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "raydcp-ray-auth", "key": "auth_token"}
    return containers


def _dockerfile() -> tuple[str, str]:
    """(base image, where the checkout is copied) of deploy/Dockerfile."""
    text = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"^FROM\s+(\S+)", text, re.M).group(1)
    dest = re.search(r"^COPY\s+(?:--\S+\s+)*\.\s+(\S+)", text, re.M).group(1)
    return base, dest


def test_dockerfile_matches_the_ray_version():
    base, dest = _dockerfile()
    assert base == f"rayproject/ray:{ray.__version__}-py311-gpu"
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_raycluster_manifest():
    docs = list(yaml.safe_load_all((DEPLOY / "raycluster.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["RayCluster"]
    rc = docs[0]
    assert rc["apiVersion"] == "ray.io/v1" and DNS_1123.match(rc["metadata"]["name"])
    images = {c["image"] for c in check_ray_cluster_spec(rc["spec"])}
    assert len(images) == 1  # head and workers run the same image


def test_rayjob_manifest_runs_the_reshard_job():
    docs = list(yaml.safe_load_all((DEPLOY / "rayjob-reshard.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["RayJob"]
    job = docs[0]
    assert job["apiVersion"] == "ray.io/v1" and DNS_1123.match(job["metadata"]["name"])
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["submissionMode"] in ("K8sJobMode", "HTTPMode")
    assert spec["backoffLimit"] >= 1  # retries are safe: the job resumes, or does nothing once done
    containers = check_ray_cluster_spec(spec["rayClusterSpec"])
    submitter = spec["submitterPodTemplate"]["spec"]["containers"]
    images = {c["image"] for c in containers + submitter}
    assert len(images) == 1
    argv = shlex.split(spec["entrypoint"])
    _, dest = _dockerfile()
    assert argv[1] == f"{dest}/jobs/reshard.py"  # where the image has it
    args, options = parse_job_command(argv)
    assert options.world_size > 1 and "://" in args.src and "://" in args.dst
    assert int(spec["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
               ["limits"]["cpu"]) >= args.num_cpus_per_actor


# ---------------------------------------------------------------- commands in the user guide

def _guide_text() -> str:
    """README.md and the pages of docs/, where the commands users copy are."""
    return "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])


def _readme_commands(marker: str) -> list[list[str]]:
    text = _guide_text()
    blocks = re.findall(r"```(?:\w*)\n(.*?)```", text, re.S)
    out = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", " ", block)  # continuation lines
        for line in joined.splitlines():
            line = line.split("  #", 1)[0].strip()
            if marker in line:
                out.append(shlex.split(line))
    return out


def test_readme_job_commands_parse():
    commands = _readme_commands("jobs/reshard.py")
    assert len(commands) >= 2
    for argv in commands:
        i = argv.index("python")
        if argv[i + 1].endswith("jobs/reshard.py") and "--help" not in argv:
            parse_job_command(argv[i:])


def test_readme_cli_commands_parse():
    commands = [argv for argv in _readme_commands("raydcp reshard") if argv[0] == "raydcp"]
    assert commands
    for argv in commands:
        if "--help" in argv:
            continue
        args = cli_parser().parse_args(argv[1:])
        options_from_args(args)


@pytest.mark.parametrize("path", ["cluster.yaml", "deploy/raycluster.yaml", "deploy/rayjob-reshard.yaml"])
def test_the_deployment_guide_points_to_the_deployment_files(path):
    assert path in (REPO / "docs" / "deployment.md").read_text()
    assert "docs/deployment.md" in (REPO / "README.md").read_text()
