"""The wire types survive the transports' pickling as themselves."""

from __future__ import annotations

import pickle

import pytest
from ray import cloudpickle

from serve_app.wire import DonePart, ErrorPart, StepMessage, TokenPart


@pytest.mark.parametrize("dumps, loads", [(pickle.dumps, pickle.loads),
                                          (cloudpickle.dumps, cloudpickle.loads)])
def test_step_message_round_trips_with_its_part_types(dumps, loads):
    msg = StepMessage([TokenPart("r1", 0, [5, 6], None, [{5: -0.5}, {6: -1.0}]),
                       TokenPart(3, 1, [7], "length", None)],
                      [DonePart("r1", 12, 8)], [ErrorPart(2, 400, "prompt too long")])
    back = loads(dumps(msg))
    assert back == msg and type(back) is StepMessage
    assert [type(p) for p in (*back.tokens, *back.done, *back.errors)] == [
        TokenPart, TokenPart, DonePart, ErrorPart]
    assert back.tokens[1].finish_reason == "length" and back.done[0].num_cached_tokens == 8
    assert back.num_finished == 2
    empty = loads(dumps(StepMessage([], [], [])))
    assert empty == StepMessage([], [], []) and type(empty) is StepMessage
