"""Deployment files are consistent: compose and kustomize reference files and ports that exist."""
import pathlib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVICES = ("sandbox", "engine", "trainer", "rollout")


def test_compose_builds_existing_dockerfiles_and_wires_ports():
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name in SERVICES:
        svc = doc["services"][name]
        assert (ROOT / svc["build"]["dockerfile"]).exists(), f"{name}: missing Dockerfile"
        assert svc["command"][:3] == ["python", "-m", f"services.{name}"]
    rollout = doc["services"]["rollout"]["command"]
    assert rollout[rollout.index("--engine-url") + 1] == "http://engine:30000"
    assert doc["services"]["trainer"]["ipc"] == "service:engine"


def test_kustomization_lists_existing_manifests():
    kust = yaml.safe_load((ROOT / "deploy/k8s/kustomization.yaml").read_text())
    kinds = {}
    for res in kust["resources"]:
        path = ROOT / "deploy/k8s" / res
        assert path.exists(), res
        for d in yaml.safe_load_all(path.read_text()):
            kinds.setdefault(d["kind"], []).append(d["metadata"]["name"])
    assert set(kinds["Service"]) == {"sandbox", "engine", "trainer", "rollout"}
    assert set(kinds["Deployment"]) == {"sandbox", "policy", "rollout"}


def test_every_service_has_entry_point_and_dockerfile():
    for name in SERVICES:
        assert (ROOT / "services" / name / "__main__.py").exists(), name
        assert (ROOT / "services" / name / "Dockerfile").exists(), name
