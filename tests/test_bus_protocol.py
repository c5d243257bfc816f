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


def test_the_pace_is_sent_when_known_and_reaches_the_contribution():
    import numpy as np

    from aggregator.contribution import from_grad_message
    from bus import codec

    m = _meta(step_s=0.2500004)
    assert m["step_s"] == 0.25 and parse_grad_meta(m) is m
    # nothing to report, or nothing the schema takes (under a microsecond, over a day): absent, so the
    # outer gradient is never malformed for its pace
    for none in (0.0, -1.0, float("nan"), float("inf"), 4e-7, 86400.5):
        assert "step_s" not in _meta(step_s=none)
    blob = codec.encode_array(np.zeros(4, np.float32), "fp32")
    assert from_grad_message(m, blob).step_s == 0.25
    assert from_grad_message(_meta(), blob).step_s == 0.0  # an older learner's


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, float("nan"), float("inf"), 86401.0, "0.2", True])
def test_a_bad_pace_is_malformed(bad):
    with pytest.raises(ValueError, match="malformed: field 'step_s'"):
        parse_grad_meta({**_meta(), "step_s": bad})


def test_a_final_sync_says_so_and_reaches_the_contribution():
    import numpy as np

    from aggregator.contribution import from_grad_message
    from bus import codec

    m = _meta(final=True)
    assert m["final"] == 1 and parse_grad_meta(m) is m
    assert "final" not in _meta(final=False)
    blob = codec.encode_array(np.zeros(4, np.float32), "fp32")
    assert from_grad_message(m, blob).final and not from_grad_message(_meta(), blob).final
    for bad in (0, 2, True, "1", 1.0):
        with pytest.raises(ValueError, match="malformed: field 'final'"):
            parse_grad_meta({**_meta(), "final": bad})


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
