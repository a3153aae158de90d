"""The reward server's config: errors name the file and the field before anything is loaded."""
import json

import numpy as np
import pytest

from unirl.stages.rewards import ScoreBatch
from unirl.stages.rewards.server import ConfigError, ScoringService, load_config, resolve_token


def write(tmp_path, text, name="server.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_and_json_with_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "scorers:\n  - {name: constant, params: {value: 1}}\n"))
    assert (cfg.host, cfg.port, cfg.auth, cfg.aggregation) == ("127.0.0.1", 8765, True, "weighted_sum")
    assert cfg.token_env == "UNIRL_REWARD_TOKEN" and cfg.scorers[0].label == "constant"
    as_json = {"scorers": [{"name": "keyword", "key": "kw", "params": {"keywords": ["a"]}}],
               "aggregation": "min", "auth": False, "port": 9000}
    cfg = load_config(write(tmp_path, json.dumps(as_json), "server.json"), port=9100)
    assert (cfg.aggregation, cfg.auth, cfg.port, cfg.scorers[0].label) == ("min", False, 9100, "kw")


@pytest.mark.parametrize("text, message", [
    ("scorers: []", "scorers: List should have at least 1 item"),
    ("scorers: [{name: constant}]\naggregation: median", "aggregation: Input should be 'weighted_sum', 'mean', 'min' or 'max'"),
    ("scorers: [{name: constant, wieght: 2}]", "scorers.0.wieght: Extra inputs are not permitted"),
    ("scorers: [{name: constant}, {name: constant}]", "scorer key 'constant' is used twice"),
    ("scorers: [{name: constant}]\nport: 0", "port: Input should be greater than or equal to 1"),
    ("scorers: [{name: constant, weight: .nan}]", "weight must be finite"),
    ("- just a list", "expected a mapping at the top level"),
    ("scorers: [", "not valid YAML: line 2, column 1"),
])
def test_invalid_configs_name_the_field(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(write(tmp_path, text))
    assert "server.yaml" in str(err.value)


def test_token_is_required_unless_auth_is_explicitly_off(tmp_path, monkeypatch):
    monkeypatch.delenv("RS_TOKEN", raising=False)
    cfg = load_config(write(tmp_path, "token_env: RS_TOKEN\nscorers: [{name: constant}]"))
    with pytest.raises(ConfigError, match=r"\$RS_TOKEN is empty"):
        resolve_token(cfg)
    monkeypatch.setenv("RS_TOKEN", "abc")
    assert resolve_token(cfg) == "abc"
    assert resolve_token(cfg.model_copy(update={"auth": False})) is None


def test_service_builds_scorers_and_aggregates(tmp_path):
    cfg = load_config(write(tmp_path, """
aggregation: weighted_sum
scorers:
  - {name: text_length, weight: 0.5}
  - {name: keyword, key: kw, weight: 2, params: {keywords: [cat]}}
"""))
    service = ScoringService(cfg)
    result = service.score(ScoreBatch(["a", "b"], ["p", "q"], texts=["cat", "dog!"]))
    np.testing.assert_allclose(result.scores, [0.5 * 3 + 2 * 1, 0.5 * 4 + 0])
    assert set(result.components) == {"text_length", "kw", "kw/hits"}


def test_unknown_scorer_or_import_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"scorers.0 \(nope\): ValueError: unknown scorer 'nope'"):
        ScoringService(load_config(write(tmp_path, "scorers: [{name: nope}]")))
    with pytest.raises(ConfigError, match="imports: cannot import 'no_such_module_xyz'"):
        ScoringService(load_config(write(tmp_path, "imports: [no_such_module_xyz]\nscorers: [{name: constant}]")))
