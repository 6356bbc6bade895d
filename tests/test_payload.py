"""How many answers a request asks for: read from ``n`` (and ``best_of``) only where the API has
them; anywhere else a field of that name passes through, whatever its type."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.payload import Endpoint, answers, generations, parse_body


def view_of(endpoint: Endpoint, body: dict[str, Any]) -> object:
    return parse_body(orjson.dumps(body), endpoint)[1]


@pytest.mark.parametrize("n", [{"": None}, [1, 2], "many", 2.5, 3])
@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("embeddings", {"model": "e", "input": "hi"}),
        ("responses", {"model": "m", "input": "hi"}),
        ("messages", {"model": "c", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_n_outside_chat_and_completions_is_one_answer(
    endpoint: Endpoint, body: dict[str, Any], n: Any
) -> None:
    view = view_of(endpoint, {**body, "n": n})
    assert answers(view) == 1
    assert generations(view) == 1


def test_n_and_best_of_where_the_api_has_them() -> None:
    chat = view_of("chat.completions", {"model": "m", "n": 3, "messages": [{"role": "user", "content": "x"}]})
    assert (answers(chat), generations(chat)) == (3, 3)
    legacy = view_of("completions", {"model": "m", "prompt": ["a", "b"], "n": 2, "best_of": 5})
    assert (answers(legacy), generations(legacy)) == (4, 10)
