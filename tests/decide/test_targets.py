"""`--compare TARGET[,key=value...]` (glmtune/decide/targets.py): each key read, and one sentence for
a key that does not apply, is unknown or repeated, a bad cost, a label that is an arm's or given
twice, and a key variable that is not set."""

from __future__ import annotations

import pytest

from glmtune.decide.targets import Target, check_labels, parse_target


def test_an_endpoint_with_every_key(monkeypatch):
    monkeypatch.setenv("ZAI_KEY", "secret")
    t = parse_target("https://api.example.com:443/v1,name=api,model=glm-4.6,api=chat,key-env=ZAI_KEY,cost-per-1k=0.8")
    assert (t.source, t.label, t.model, t.api, t.key_env, t.cost_per_1k) == (
        "https://api.example.com:443/v1", "api", "glm-4.6", "chat", "ZAI_KEY", 0.8)
    assert t.is_endpoint and "secret" not in repr(t)


def test_default_labels(tmp_path):
    assert parse_target("http://10.0.0.2:8000/v1").label == "10.0.0.2:8000"
    assert parse_target(str(tmp_path / "runs" / "small-model")).label == "small-model"
    assert parse_target(str(tmp_path) + ",cost-per-1k=0").cost_per_1k == 0.0


@pytest.mark.parametrize("spec, message", [
    ("runs/x,api=chat", "api= applies to an endpoint (http(s)://HOST:PORT/v1); runs/x is a local model"),
    ("runs/x,key-env=K", "key-env= applies to an endpoint"),
    ("http://h:1/v1,colour=red", "'colour=red' is not one of name=, model=, api=, key-env=, cost-per-1k="),
    ("http://h:1/v1,chat", "'chat' is not one of"),
    ("http://h:1/v1,name=a,name=b", "name= given twice"),
    ("http://h:1/v1,api=responses", "api=responses: expected one of completions, chat"),
    ("runs/x,cost-per-1k=-1", "cost-per-1k=-1: expected a finite cost >= 0"),
    ("runs/x,cost-per-1k=nan", "cost-per-1k=nan: expected a finite cost >= 0"),
    ("runs/x,name=a b", "name 'a b': a label is letters, digits"),
    (",name=x", "no target before the options"),
    ("http://h:1/v1,key-env=GLMTUNE_SURELY_UNSET_VAR", "key-env: the environment variable GLMTUNE_SURELY_UNSET_VAR is "
                                                       "not set (or empty)"),
    ("http://h:1/v1,key-env=1BAD", "key-env: '1BAD' is not an environment variable name"),
])
def test_what_would_not_take_effect_is_refused(spec, message):
    with pytest.raises(ValueError) as err:
        parse_target(spec)
    assert str(err.value).startswith(f"--compare {spec}: ") and message in str(err.value)


@pytest.mark.parametrize("labels, message", [(["retrieval"], "the label 'retrieval' is an arm's"),
                                             (["a", "a"], "the label 'a' is given twice")])
def test_labels_are_the_arms_own(labels, message):
    with pytest.raises(ValueError, match=message):
        check_labels([Target(f"x{i},name={label}", f"x{i}", label) for i, label in enumerate(labels)])
