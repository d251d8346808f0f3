"""Deployment files are consistent: images run their service, compose and kustomize pass only flags to it."""
import json
import pathlib
import re

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVICES = ("sandbox", "engine", "trainer", "rollout")


def _entrypoint(name: str) -> list[str]:
    text = (ROOT / "services" / name / "Dockerfile").read_text()
    match = re.search(r"^ENTRYPOINT (\[.*\])$", text, flags=re.M)
    assert match, f"{name}: Dockerfile has no exec-form ENTRYPOINT"
    return json.loads(match.group(1))


def test_every_service_has_entry_point_and_dockerfile():
    for name in SERVICES:
        assert (ROOT / "services" / name / "__main__.py").exists(), name
        assert f"services.{name}" in " ".join(_entrypoint(name)), name


def test_compose_passes_flags_to_each_image():
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name in SERVICES:
        svc = doc["services"][name]
        assert (ROOT / svc["build"]["dockerfile"]).exists(), f"{name}: missing Dockerfile"
        assert svc["command"][0].startswith("--"), f"{name}: command must be flags (ENTRYPOINT is the service)"
    rollout = doc["services"]["rollout"]["command"]
    assert rollout[rollout.index("--engine-url") + 1] == "http://engine:30000"
    assert doc["services"]["trainer"]["ipc"] == "service:engine"
    assert "model_store provision" in " ".join(doc["services"]["provision"]["entrypoint"])


def test_kustomization_lists_existing_manifests_and_containers_pass_flags():
    kust = yaml.safe_load((ROOT / "deploy/k8s/kustomization.yaml").read_text())
    kinds: dict[str, list[str]] = {}
    for res in kust["resources"]:
        path = ROOT / "deploy/k8s" / res
        assert path.exists(), res
        for d in yaml.safe_load_all(path.read_text()):
            kinds.setdefault(d["kind"], []).append(d["metadata"]["name"])
            if d["kind"] == "Deployment":
                for c in d["spec"]["template"]["spec"]["containers"]:
                    assert c["args"][0].startswith("--"), f"{c['name']}: args must be flags"
    assert set(kinds["Service"]) == {"sandbox", "engine", "trainer", "rollout"}
    assert set(kinds["Deployment"]) == {"sandbox", "policy", "rollout"}
