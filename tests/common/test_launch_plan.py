"""The launcher turns a config's `services:` section into start commands and endpoints."""
import pathlib

import pytest
import yaml

from services.launch.stack import plan
from services.launch.watch import format_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_plan_defaults_and_overrides():
    specs, ep = plan({"model": "m", "engine": {"port": 31000, "device": "cpu", "dtype": "float32"},
                      "trainer": {"device": "cpu", "args": ["--lr", "1e-5"]}})
    names = [s.name for s in specs]
    assert names == ["sandbox", "engine", "trainer", "rollout"]
    engine = specs[1]
    assert engine.args[:2] == ["--port", "31000"] and "--dtype" in engine.args
    assert engine.http_health == "http://127.0.0.1:31000/health_generate"
    assert specs[2].args[-2:] == ["--lr", "1e-5"]
    trainer = specs[2].args
    assert trainer[trainer.index("--checkpoint-dir") + 1] == "runs/checkpoints"
    rollout = specs[3].args
    assert rollout[rollout.index("--engine-url") + 1] == "http://127.0.0.1:31000"
    assert rollout[rollout.index("--trainer-addr") + 1] == "127.0.0.1:50052"
    assert ep.rollout_http == "http://127.0.0.1:8080"


def test_bad_extra_args_rejected():
    with pytest.raises(ValueError, match="list of strings"):
        plan({"engine": {"args": "--x"}})
    with pytest.raises(ValueError, match="mapping"):
        plan({"engine": {"env": ["CUDA_VISIBLE_DEVICES=1"]}})


def test_service_env_reaches_the_spec():
    specs, _ = plan({"engine": {"device": "cuda:0", "env": {"CUDA_VISIBLE_DEVICES": 1}}})
    assert specs[1].env == {"CUDA_VISIBLE_DEVICES": "1"} and specs[0].env == {}


def test_metrics_line_puts_headline_first():
    line = format_metrics(3, {"zeta": 1.0, "loss": 0.25, "reward_mean": 0.5})
    assert line.index("reward_mean") < line.index("loss") < line.index("zeta")


@pytest.mark.parametrize("cfg", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_have_both_sections(cfg):
    doc = yaml.safe_load(cfg.read_text())
    assert isinstance(doc.get("run"), dict) and isinstance(doc.get("services"), dict)
    plan(doc["services"])


def test_throwaway_stack_gets_its_own_folders_and_ports(tmp_path):
    from services.launch.stack import throwaway_stack
    st = throwaway_stack(tmp_path)
    args = {s.name: s.args for s in st.specs}
    sandbox = args["sandbox"]
    home = tmp_path / "sandbox-home"
    assert sandbox[sandbox.index("--home") + 1] == str(home)
    assert (home / "templates").is_symlink()
    ports = [st.endpoints.sandbox_grpc, st.endpoints.trainer_grpc, st.endpoints.rollout_grpc]
    assert len(set(ports)) == 3


def test_run_section_takes_the_served_model_unless_the_run_names_one():
    from services.launch.__main__ import run_section
    doc = {"services": {"model": "/models/m"}, "run": {"steps": 2}}
    assert run_section(doc) == {"steps": 2, "model": "/models/m"}
    assert doc["run"] == {"steps": 2}  # the config itself is left as it was
    assert run_section({"services": {"model": "/models/m"}, "run": {"model": "other"}})["model"] == "other"
    assert "model" not in run_section({"run": {"steps": 1}})
