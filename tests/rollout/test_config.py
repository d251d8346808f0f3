"""Run configs: typed, strict (a wrong field is named), JSON or YAML, and the shipped configs/*.yaml."""
from __future__ import annotations

import pathlib

import pytest
import yaml

from services.rollout.config import ConfigError, RunConfig, parse_config
from services.rollout.validation import check_runnable

CONFIGS = sorted((pathlib.Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_defaults_and_aliases():
    cfg = parse_config('{"mode": "async", "async": {"staleness_k": 2}}')
    assert cfg.mode == "async" and cfg.asynchronous.staleness_k == 2
    assert cfg.group_size == 4 and cfg.advantage.eps == 1e-4
    assert parse_config("steps: 3\nsampling: {temperature: 0.7}\n").sampling.temperature == 0.7
    assert parse_config("").steps == RunConfig().steps


@pytest.mark.parametrize("text,field", [
    ('{"group_sise": 4}', "group_sise"),
    ('{"sampling": {"temprature": 1}}', "sampling.temprature"),
    ('{"mode": "fast"}', "mode"),
    ('{"steps": 0}', "steps"),
    ('{"episode": {"max_response_tokens": 4096, "context_limit": 1024}}', "max_response_tokens"),
])
def test_bad_fields_are_named(text, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config(text)


def test_unknown_tasks_and_models_are_named():
    with pytest.raises(ConfigError, match="tasks.*nope"):
        check_runnable(RunConfig(tasks=["nope"]))
    with pytest.raises(ConfigError, match="model"):
        check_runnable(RunConfig(model="/no/such/model"))
    check_runnable(RunConfig(tasks=["python_product"]))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_files(path):
    doc = yaml.safe_load(path.read_text())
    assert set(doc) >= {"services", "run"}
    assert {"model", "engine", "trainer", "sandbox", "rollout"} <= set(doc["services"])
    cfg = RunConfig.model_validate(doc["run"])
    check_runnable(cfg)
    assert parse_config(path.read_text()) == cfg
