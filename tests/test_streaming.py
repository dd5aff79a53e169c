"""streamer=: Transformers' streamer protocol (put, end) receives exactly the generated tokens as they commit."""

from __future__ import annotations

import pytest
import torch
from helpers import make_draft, make_target, make_tokenizer, plain_greedy
from transformers import TextIteratorStreamer


class RecordingStreamer:
    """Records every put() and end() call."""

    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        assert self.ended == 0, "put() after end()"
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ended += 1


@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_streamer_receives_prompt_then_each_committed_token(block_size):
    target = make_target("qwen3", seed=20)
    draft = make_draft(20)
    prompt = torch.tensor([[5, 9, 3, 7]])
    streamer = RecordingStreamer()
    result = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=25, block_size=block_size,
                                 streamer=streamer, return_stats=True)
    assert torch.equal(streamer.puts[0], prompt)  # like generate: the prompt first
    streamed = torch.cat([value.flatten() for value in streamer.puts[1:]]).tolist()
    assert streamed == result.new_tokens(0) == plain_greedy(target, prompt, 25)[0, 4:].tolist()
    assert len(streamer.puts) - 1 == 1 + len(result.acceptance_lengths[0])  # the first token, then one put per step
    assert streamer.ended == 1


def test_text_iterator_streamer_gets_the_generated_text():
    target = make_target("llama", seed=21)
    draft = make_draft(21)
    tokenizer = make_tokenizer()
    prompt = torch.tensor([[3, 40, 41, 4]])
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    out = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=30, streamer=streamer,
                              stop_token_ids=[1])
    text = "".join(streamer)  # generation is over: the queue holds every chunk and the end signal
    assert text == tokenizer.decode(out[0, 4:])
    assert len(text.split()) == out.shape[1] - 4


def test_one_streamer_per_row_in_a_batch():
    target = make_target("qwen3", seed=22)
    draft = make_draft(22)
    prompts = [torch.tensor([[5, 9, 3, 7, 2]]), torch.tensor([[8, 1]])]
    input_ids = torch.tensor([[5, 9, 3, 7, 2], [0, 0, 0, 8, 1]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
    streamers = [RecordingStreamer(), RecordingStreamer()]
    result = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask,
                                 max_new_tokens=20, streamer=streamers, return_stats=True)
    for row, (prompt, streamer) in enumerate(zip(prompts, streamers)):
        assert torch.equal(streamer.puts[0], prompt)  # each row's own prompt, without padding
        streamed = torch.cat([value.flatten() for value in streamer.puts[1:]]).tolist()
        assert streamed == result.new_tokens(row) == plain_greedy(target, prompt, 20)[0, prompt.shape[1]:].tolist()
        assert streamer.ended == 1
