"""Prompt encoding errors name the field; streamed text deltas hold back split characters and stop strings."""

from __future__ import annotations

import pickle

import pytest
from transformers import AutoTokenizer

from specserve.engine.prompts import PromptCodec, PromptError
from specserve.models import embedded


@pytest.fixture(scope="module")
def codec():
    tokenizer = AutoTokenizer.from_pretrained(str(embedded.converted_dir(embedded.embedded_gguf_path())))
    return PromptCodec(tokenizer, len(tokenizer), max_positions=64)


@pytest.mark.parametrize(
    ("prompt", "field"),
    [("", "prompt"), ([], "prompt"), ([1, 2, 10**6], "prompt"), ([{"role": "user"}], "prompt[0]"), (3, "prompt")],
)
def test_bad_prompts_name_the_field(codec, prompt, field):
    with pytest.raises(PromptError) as info:
        codec.encode(prompt)
    assert info.value.field == field and str(info.value).startswith(field + ":")


def test_prompt_error_survives_pickling():  # it crosses Ray process boundaries
    error = pickle.loads(pickle.dumps(PromptError("sampling.top_p", "must be <= 1")))
    assert (error.field, error.message) == ("sampling.top_p", "must be <= 1")


def test_context_limit(codec):
    assert codec.check_length([1] * 10) == 54
    with pytest.raises(PromptError, match="context is 64"):
        codec.check_length([1] * 64, "messages")


def test_stream_deltas_join_to_the_full_text_and_never_split_a_character(codec):
    text = "Café ☕ — naïve façade 🚀 done."
    ids = codec.tokenizer.encode(text)
    stream = codec.stream()
    deltas = [stream.push([t]) for t in ids[:-1]] + [stream.push(ids[-1:], final=True)]
    assert "".join(deltas) == codec.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_stream_cuts_at_a_stop_string_spanning_tokens(codec):
    ids = codec.tokenizer.encode("one two three four five six")
    stream = codec.stream(stop=["four f"])
    out = []
    for t in ids:
        out.append(stream.push([t]))
        if stream.stopped:
            break
    assert "".join(out) == "one two three "
    assert stream.stopped
