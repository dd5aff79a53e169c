"""`dflash-hf chat`: a streaming terminal chat with SmolLM2-135M-Instruct and the shipped draft.

Each answer is written as `spec_generate` commits it, the tokens the draft proposed and the target accepted set apart
(in colour on a terminal that has it, else between plain-text marks), then its tokens/s and tau. The conversation is
kept through the chat template until /reset. See docs/chat.md.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO

import torch

from .demo import DEMO_PROMPTS, choose_decoding, load_demo
from .generation_dflash import SpecGenerateOutput
from .prompts import chat_prompt_ids, user_prompt_ids
from .tokens_dflash import generation_tokens


@dataclass(frozen=True)
class Marks:
    """What is written before and after a run of accepted draft tokens, and how the legend names it."""

    start: str
    end: str
    legend: str


COLOR_MARKS = Marks("\033[32m", "\033[0m", "\033[32mgreen\033[0m")  # green text, then the terminal's default again
PLAIN_MARKS = Marks("[", "]", "[in brackets]")
COLOR_CHOICES = ("auto", "always", "never")
USER_PROMPT = "you> "


def terminal_has_color(stream: TextIO, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether `stream` shows colour: a terminal (isatty) whose TERM is set and not "dumb", with NO_COLOR unset or
    empty (no-color.org)."""
    return bool(stream.isatty() and environ.get("TERM", "dumb") != "dumb" and not environ.get("NO_COLOR"))


def choose_marks(color: str, stream: TextIO, environ: Mapping[str, str] = os.environ) -> Marks:
    """`--color`: "always" colours the accepted draft tokens, "never" marks them in plain text, "auto" colours where
    `stream` is a terminal with colour (`terminal_has_color`)."""
    if color not in COLOR_CHOICES:
        raise ValueError(f"color must be one of {', '.join(COLOR_CHOICES)}, got {color!r}")
    colored = color == "always" or (color == "auto" and terminal_has_color(stream, environ))
    return COLOR_MARKS if colored else PLAIN_MARKS


class MarkingStreamer:
    """A `spec_generate` streamer (Transformers' put/end protocol) that writes one row's answer as it is committed,
    each run of tokens the draft got right between `marks.start` and `marks.end`.

    `spec_generate` puts the prompt, then the first new token (the target's, from the prompt's pass), then one tensor
    per draft/verify step: that step's accepted proposals followed by the target's own token (a final step cut after
    a stop token ends on a proposal: the stop token, which the text does not show). Text is decoded from all tokens
    so far, so a character split over several tokens is written once complete, marked only if each of its tokens
    was the draft's.
    """

    def __init__(self, tokenizer: Any, write: Callable[[str], Any], marks: Marks) -> None:
        self.tokenizer, self.write, self.marks = tokenizer, write, marks
        self.tokens: list[int] = []
        self.drafted: list[bool] = []  # per token: an accepted proposal of the draft
        self.puts = 0
        self.shown = 0  # tokens whose text is written
        self.text = ""  # the text of tokens[:shown]
        self.inside = False  # a marked run is open
        self.held = ""  # whitespace after the open run's text, not yet written

    @property
    def accepted(self) -> int:
        """Accepted draft tokens so far."""
        return sum(self.drafted)

    def put(self, value: torch.Tensor) -> None:
        """Take the prompt (skipped), the first token, or one step's committed tokens [k]."""
        self.puts += 1
        if self.puts == 1:
            return  # the prompt
        ids = value.flatten().tolist()
        self.tokens += ids
        self.drafted += [False] * len(ids) if self.puts == 2 else [True] * (len(ids) - 1) + [False]
        self.flush(final=False)

    def end(self) -> None:
        """Write what is left and close an open mark (also after an interrupted call)."""
        self.flush(final=True)
        self.emit("", marked=False)

    def flush(self, final: bool) -> None:
        """Write the text of the tokens not yet shown; hold back a character still incomplete unless `final`."""
        for index in range(self.shown, len(self.tokens)):
            text = self.tokenizer.decode(self.tokens[: index + 1], skip_special_tokens=True)
            if text.endswith("\ufffd") and not final:
                continue  # a character split over tokens: wait for its next token
            self.emit(text[len(self.text):], marked=all(self.drafted[self.shown : index + 1]))
            self.text, self.shown = text, index + 1

    def emit(self, span: str, marked: bool) -> None:
        """Write `span`, opening or closing a mark where `marked` changes; whitespace around a marked run (a space
        before it, a line break after it) stays out of it."""
        if not marked:
            if self.inside:
                self.write(self.marks.end)
                self.inside = False
            self.write(self.held + span)
            self.held = ""
            return
        text, self.held = self.held + span, ""
        if not self.inside:
            body = text.lstrip()
            self.write(text[: len(text) - len(body)])
            if not body:
                return
            self.write(self.marks.start)
            self.inside, text = True, body
        core = text.rstrip()
        self.held = text[len(core):]  # inside the run if it goes on, after it if it ends here
        self.write(core)


@dataclass
class ChatTurn:
    """One answer of the chat: its text, its tokens and the call's statistics."""

    text: str
    token_ids: list[int]
    accepted: int  # accepted draft tokens among token_ids
    result: SpecGenerateOutput

    def summary(self, marks: Marks) -> str:
        """The line written after the answer: tokens, tokens/s, tau, accepted draft tokens."""
        return (f"[{len(self.token_ids)} tokens | {self.result.tokens_per_second:.1f} tokens/s | tau "
                f"{self.result.tau:.2f} | {self.accepted} draft tokens accepted, {marks.legend}]")


class ChatSession:
    """A conversation with `target`, decoded by `draft.spec_generate`: the messages so far, rendered by the chat
    template for each new user message."""

    def __init__(self, target: torch.nn.Module, tokenizer: Any, draft: torch.nn.Module, max_new_tokens: int = 256,
                 temperature: float = 0.0, seed: int = 0, **decoding: Any) -> None:
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        self.max_new_tokens, self.temperature, self.decoding = max_new_tokens, temperature, decoding
        self.stop_token_ids = generation_tokens(target, tokenizer, draft).stop_token_ids
        self.generator = torch.Generator().manual_seed(seed)  # one stream over the turns (sampling only)
        self.messages: list[dict[str, str]] = []

    def reset(self) -> None:
        """Forget the conversation."""
        self.messages = []

    def prompt_ids(self, text: str) -> tuple[list[int], int]:
        """The ids of the conversation with the user's `text` appended, rendered with the generation prompt, and how
        many earlier exchanges were left out so that it and the answer fit the target's context."""
        limit = getattr(self.target.config, "max_position_embeddings", None)
        history, dropped = self.messages, 0
        while True:
            ids = chat_prompt_ids(self.tokenizer, [*history, {"role": "user", "content": text}])
            if limit is None or len(ids) + self.max_new_tokens <= limit:
                return ids, dropped
            if not history:
                raise ValueError(f"This message is {len(ids)} tokens: with {self.max_new_tokens} new tokens it "
                                 f"does not fit the model's {limit}-token context. Send a shorter one.")
            history, dropped = history[2:], dropped + 1  # the oldest user message and its answer

    def answer(self, text: str, write: Callable[[str], Any], marks: Marks) -> ChatTurn:
        """Answer the user's `text`, streaming it to `write` with the accepted draft tokens marked; the exchange joins
        the conversation (not if the call is interrupted)."""
        ids, dropped = self.prompt_ids(text)
        if dropped:
            write(f"(the {dropped} oldest exchange{'s' if dropped > 1 else ''} left out: the context is full)\n")
            self.messages = self.messages[2 * dropped:]
        streamer = MarkingStreamer(self.tokenizer, write, marks)
        try:
            result = self.draft.spec_generate(
                target=self.target, input_ids=torch.tensor([ids]), max_new_tokens=self.max_new_tokens,
                temperature=self.temperature, generator=self.generator, stop_token_ids=self.stop_token_ids,
                streamer=streamer, return_stats=True, **self.decoding)
        finally:
            streamer.end()  # a mark left open would colour what follows
        token_ids = result.new_tokens(0)
        answer = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        self.messages = [*self.messages, {"role": "user", "content": text}, {"role": "assistant", "content": answer}]
        return ChatTurn(answer, token_ids, streamer.accepted, result)


def chat_loop(session: ChatSession, read: Callable[[str], str], write: Callable[[str], Any], marks: Marks,
              echo: bool = False) -> list[ChatTurn]:
    """Read user lines with `read` until /quit or the end of input, answer each through `session`; /reset clears
    the conversation. `echo`: write each line read (input that is not a terminal shows none). Returns the answers."""
    turns: list[ChatTurn] = []
    while True:
        try:
            line = read(USER_PROMPT)
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return turns
        text = line.strip()
        if echo:
            write(line.rstrip("\n") + "\n")
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return turns
        if text == "/reset":
            session.reset()
            write("(conversation cleared)\n")
            continue
        if text.startswith("/"):
            write(f"unknown command {text}: /reset clears the conversation, /quit leaves\n")
            continue
        try:
            turn = session.answer(text, write, marks)
        except KeyboardInterrupt:
            write("\n(stopped: this exchange is not kept)\n")
            continue
        except ValueError as error:  # a message too long for the context
            write(f"{error}\n")
            continue
        turns.append(turn)
        write(f"\n{turn.summary(marks)}\n\n")


def run_chat(max_new_tokens: int = 256, dtype: torch.dtype = torch.float32, draft_path: str | Path | None = None,
             block_size: int | str = "auto", tree_size: int | str | None = None,
             cpu_kernels: bool | str | None = None, temperature: float = 0.0, seed: int = 0, color: str = "auto",
             read: Callable[[str], str] | None = None, output: TextIO | None = None) -> list[ChatTurn]:
    """Chat with SmolLM2-135M-Instruct and the shipped draft (or `draft_path`) in the terminal: greedy by default
    (`temperature` > 0 samples, `seed`). block_size, tree_size and cpu_kernels as `demo.run_demo` takes them, chosen
    on this machine before the first message where "auto" (or None for cpu_kernels). `read`: a line reader (default
    `input`); `output`: where the chat is written (default stdout). Returns the answers."""
    output = output or sys.stdout
    marks = choose_marks(color, output)
    if read is None and sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())

    def write(text: str) -> None:
        output.write(text)
        output.flush()

    target, tokenizer, draft = load_demo(dtype, draft_path)
    if "auto" in (block_size, tree_size) or block_size == "adaptive" or cpu_kernels is None:
        print("timing this machine to choose the block, tree and kernels (--block-size 3 --tree-size 0 "
              "--cpu-kernels on skip it) ...", flush=True)
    tokens = generation_tokens(target, tokenizer, draft)
    decoding = choose_decoding(draft, target, user_prompt_ids(tokenizer, DEMO_PROMPTS[1]), tokens, max_new_tokens,
                               block_size, tree_size, cpu_kernels)  # on the demo's general question
    session = ChatSession(target, tokenizer, draft, max_new_tokens, temperature, seed,
                          block_size=decoding.block_size, tree_size=decoding.tree_size,
                          cpu_kernels=decoding.cpu_kernels, step_costs=decoding.step_costs)
    shape = f"a tree of {decoding.tree_size}" if decoding.tree_size else "a chain"
    write(f"SmolLM2-135M-Instruct with the shipped DFlash draft: block size {decoding.block_size}, {shape}, "
          f"{'greedy' if temperature == 0 else f'temperature {temperature}'}, {dtype}.\n"
          f"Tokens the draft proposed and the target accepted are {marks.legend}; the rest are the target's own.\n"
          "/reset clears the conversation, /quit (or Ctrl-D) leaves.\n\n")
    return chat_loop(session, read or input, write, marks, echo=read is None and not sys.stdin.isatty())
