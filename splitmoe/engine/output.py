"""What the front end makes of the tokens the ranks send: text (incremental detokenizing),
stop strings, and a streamed sequence's text deltas. Public: `LLM` and the server both use it.
"""

from __future__ import annotations

import logging

from splitmoe.outputs import RequestOutput, request_error
from splitmoe.sampling_params import SamplingParams

logger = logging.getLogger("splitmoe")


class Detokenizer:
    """Text deltas of one request's output, decoding only the tokens since the last delta plus
    the ones before them that give them context (the prefix and read offsets of vLLM's
    incremental detokenizer), not the whole output at every token. A delta waits while the text
    ends in an incomplete character. At the end, what the full decode adds is the last delta, so
    the deltas add up to the output's text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix = self.read = 0  # token offsets: context start, end of what was emitted
        self.text = ""  # emitted so far

    def delta(self, out: RequestOutput) -> str:
        if out.finished:
            rest = out.text[len(self.text) :] if out.text.startswith(self.text) else ""
            self.text += rest
            return rest
        ids = out.token_ids
        before = self.tokenizer.decode(ids[self.prefix : self.read])
        after = self.tokenizer.decode(ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(ids)
        new = after[len(before) :]
        self.text += new
        return new


class StopWatch:
    """Finds a request's stop strings in its decoded output as its tokens arrive.

    As vLLM's detokenizer: text that arrives while at most ``min_tokens`` tokens were generated
    is not searched (a stop string may still begin in it and end later)."""

    def __init__(self, tokenizer, strings: tuple[str, ...], min_tokens: int = 0):
        self.detok = Detokenizer(tokenizer)
        self.strings = strings
        self.min_tokens = min_tokens
        self.hit: tuple[int, str] | None = None  # (tokens kept, text kept) once one appeared

    def check(self, out: RequestOutput) -> bool:
        """Whether a stop string has appeared (now or before); the first occurrence wins."""
        if self.hit is None:
            new = self.detok.delta(out)
            if new and len(out.token_ids) > self.min_tokens:
                text = self.detok.text
                end = len(text) - len(new)  # (each string is looked for where it could end)
                found = [
                    i
                    for i in (text.find(x, max(0, end - len(x) + 1)) for x in self.strings)
                    if i >= 0
                ]
                if found:
                    self.hit = (len(out.token_ids), text[: min(found)])
        return self.hit is not None


def front_end_fault(request_id: int, stage: str, error: Exception) -> str:
    """Logs a fault that fails one request alone (with its traceback); returns its error."""
    logger.error("request %d failed in %s and is ended", request_id, stage, exc_info=error)
    return request_error(stage, error)


class TextStream:
    """A streamed sequence's text deltas; with stop strings the last ``len(longest) - 1``
    characters wait until it is sure they do not begin a stop string (the final text, cut
    before the stop string, is a continuation of what was sent)."""

    def __init__(self, tokenizer, params: SamplingParams):
        self.detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self.hold = max(map(len, params.stop), default=1) - 1
        self.sent_text = 0  # characters sent
        self.sent_tokens = 0

    def delta(self, out: RequestOutput) -> tuple[list[int], str, list | None]:
        tokens = out.token_ids[self.sent_tokens :]
        lps = None if out.logprobs is None else out.logprobs[self.sent_tokens :]
        self.sent_tokens = len(out.token_ids)
        text = ""
        if self.detok is not None:
            if out.finished:
                full = out.text or ""
            else:
                self.detok.delta(out)
                full = self.detok.text
                full = full[: max(self.sent_text, len(full) - self.hold)]
            text = full[self.sent_text :]
            self.sent_text = max(self.sent_text, len(full))
        return tokens, text, lps
