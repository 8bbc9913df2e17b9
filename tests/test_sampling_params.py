"""SamplingParams validation: a value outside a field's domain raises SamplingParamError naming the
field, including values Python would coerce quietly (a string for a flag, a dict for a list)."""

import math
import random

import pytest

from lazyrt.sampling_params import SamplingParamError, SamplingParams


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"ignore_eos": "no"}, "ignore_eos"),  # a non-empty string is truthy: it would turn it on
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": True}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"stop": 5}, "stop"),
        ({"stop": {"a": 1}}, "stop"),  # list() of a dict would keep its keys
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": {3, 4}}, "stop_token_ids"),
        ({"logit_bias": {"²": 1.0}}, "logit_bias"),  # a digit to str.isdigit(), not to int()
        ({"logit_bias": {"7" * 5000: 1.0}}, "logit_bias"),  # int() of it raises past 4,300 digits
    ],
)
def test_values_outside_a_fields_domain_name_the_field(kw, field):
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**kw)
    assert info.value.param == field and field in str(info.value)


def test_valid_values_are_kept():
    rng = random.Random()
    t, p, tok = rng.uniform(0, 2), rng.uniform(0.01, 1), rng.randrange(0, 50_000)
    sp = SamplingParams(temperature=t, top_p=p, ignore_eos=True, stop=("x", "yz"), stop_token_ids=(tok,),
                        logit_bias={f" {tok}": 1.5, str(-0): -2.0})  # fmt: skip
    assert (sp.temperature, sp.top_p, sp.ignore_eos) == (t, p, True)
    assert sp.stop == ["x", "yz"] and sp.stop_token_ids == [tok]
    assert sp.logit_bias == {tok: 1.5, 0: -2.0} or (tok == 0 and sp.logit_bias == {0: -2.0})
    assert SamplingParams(stop="end").stop == ["end"] and SamplingParams(stop=None).stop == []
