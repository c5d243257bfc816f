"""The metadata of an outer-gradient object: fields, the optional period, and what is refused."""

import pytest

from bus.protocol import GRAD_FIELDS, grad_meta, parse_grad_meta


def _meta(**kw):
    base = dict(run="r", model="h", learner="l-0", incarnation="i", fragment=1, round_=2, base_version=3,
                inner_steps=24, tokens=24 * 64, region="eu")
    return grad_meta(**{**base, **kw})


def test_period_is_sent_when_known_and_parsed():
    m = _meta(period=24)
    assert m["period"] == 24 and parse_grad_meta(m) is m
    assert "period" not in _meta() and set(parse_grad_meta(_meta())) == set(GRAD_FIELDS)  # an older learner's


def test_lockstep_is_sent_by_a_synchronous_learner_only():
    m = _meta(lockstep=True)
    assert m["lockstep"] == 1 and parse_grad_meta(m) is m
    assert "lockstep" not in _meta(lockstep=False)


@pytest.mark.parametrize("bad", [0, 2, True, "1", 1.0])
def test_a_bad_lockstep_is_malformed(bad):
    with pytest.raises(ValueError, match="malformed: field 'lockstep'"):
        parse_grad_meta({**_meta(), "lockstep": bad})


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "24", 2**40])
def test_a_bad_period_is_malformed(bad):
    m = {**_meta(), "period": bad}
    with pytest.raises(ValueError, match="malformed: field 'period'"):
        parse_grad_meta(m)


def test_unknown_or_missing_fields_are_malformed():
    with pytest.raises(ValueError, match="malformed: expected fields"):
        parse_grad_meta({**_meta(), "extra": 1})
    m = _meta()
    del m["steps"]
    with pytest.raises(ValueError, match="malformed: expected fields"):
        parse_grad_meta(m)
