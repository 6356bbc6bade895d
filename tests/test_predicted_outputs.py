"""Chat completions with a Predicted Output (``prediction``): the prediction's tokens the answer
did not take are billed as output and never shown, so a count of the answer cannot bill them."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import Proxy, ProxyFactory
from tests.fake_upstream import FakeUpstream
from tests.outcome_helpers import MODEL, MSGS, JsonDict, raw_post, the_entry
from tests.test_outcomes_stream import leave_mid_stream

PREDICTION: JsonDict = {"type": "content", "content": "tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7 " * 10}
# The provider's count: 8 tokens shown, 30 of the prediction it wrote and threw away (billed as
# output: "counted in the total completion tokens for purposes of billing").
REJECTED_USAGE: JsonDict = {
    "completion_tokens": 38,
    "completion_tokens_details": {"accepted_prediction_tokens": 8, "rejected_prediction_tokens": 30},
}


def predicted(*, stream: bool, cap: int, fake: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": MSGS,
        "stream": stream,
        "max_completion_tokens": cap,
        "prediction": PREDICTION,
        "fake": fake,
    }


@pytest.mark.parametrize("stream", [True, False])
async def test_predicted_output_without_usage_is_not_billed_below_the_providers_bill(
    proxy: Proxy, fake: FakeUpstream, stream: bool
) -> None:
    """Rejected prediction tokens are billed and never shown: a count of the text misses them."""
    body = predicted(stream=stream, cap=100, fake={"no_usage": True, "usage": REJECTED_USAGE})
    result = await raw_post(proxy, body, "pred")
    assert result.status == 200
    assert fake.received[-1].body["prediction"] == PREDICTION  # passed on as it came
    entry = await the_entry(proxy, "pred")
    assert entry["outcome"] == "ok"
    assert fake.bill[0].completion_tokens == 38
    assert int(entry["output_tokens"]) >= fake.bill[0].completion_tokens, entry


async def test_predicted_output_with_usage_bills_the_rejected_tokens(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    body = predicted(stream=True, cap=100, fake={"usage": REJECTED_USAGE})
    result = await raw_post(proxy, body, "pred")
    assert result.status == 200
    assert b'"usage"' not in result.body
    entry = await the_entry(proxy, "pred")
    assert (entry["outcome"], entry["usage_source"], entry["output_tokens"]) == ("ok", "provider", "38")
    assert entry["reserved_output_tokens"] == "100"


async def test_predicted_output_is_billed_its_reserve_when_a_cancelled_stream_left_no_usage(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    """``on_client_disconnect: cancel`` counts what streamed: a Predicted Output's rejected
    tokens never stream, as a reasoning call's reasoning does not: its output reserved."""
    proxy = await make_proxy(policy={"on_client_disconnect": "cancel"})
    ctl = {"chunk_delay_s": 0.05, "reply_tokens": 40}
    await leave_mid_stream(proxy, "gone", ctl, max_completion_tokens=100, prediction=PREDICTION)
    entry = await the_entry(proxy, "gone", wait_s=5)
    assert entry["outcome"] == "client_disconnected"
    assert (entry["usage_source"], entry["output_tokens"]) == ("reserve", "100"), entry


async def test_provider_output_above_the_reserved_cap_is_billed_and_told_as_overshoot(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    """What the provider bills stands, above the reserve too (its overshoot in the entry)."""
    body = predicted(stream=True, cap=10, fake={"usage": REJECTED_USAGE})
    assert (await raw_post(proxy, body, "over")).status == 200
    entry = await the_entry(proxy, "over")
    assert (entry["usage_source"], entry["output_tokens"], entry["reserved_output_tokens"]) == (
        "provider",
        "38",
        "10",
    )
    held = int(entry["reserved_input_tokens"]) + int(entry["reserved_output_tokens"])
    assert int(entry["overshoot_tokens"]) == int(entry["total_tokens"]) - held > 0


async def test_a_predicted_output_without_a_cap_is_capped_in_the_field_the_provider_takes(
    proxy: Proxy, fake: FakeUpstream
) -> None:
    """OpenAI refuses ``max_completion_tokens`` beside a ``prediction`` (its Predicted Outputs
    guide and Azure's list it among the parameters not supported; ``max_tokens`` is taken): a
    request with no cap of its own was forwarded with the cap the proxy reserves in
    ``max_completion_tokens``, a valid request turned into a 400 (found by the reserve hunt)."""
    body = {"model": MODEL, "messages": MSGS, "prediction": PREDICTION}
    result = await raw_post(proxy, body, "predicted-uncapped")
    assert result.status == 200
    sent = fake.received[-1].body
    assert "max_completion_tokens" not in sent, sent
    assert sent["max_tokens"] == 1000  # the model's max_output_tokens in the tests' config
    entry = await the_entry(proxy, "predicted-uncapped")
    assert entry["reserved_output_tokens"] == "1000"
