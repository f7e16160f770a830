"""Engine outputs -> OpenAI response bodies and stream chunks (completions and chat).

One builder per HTTP call. Choice indices are `prompt_index * n + choice`, as OpenAI numbers the
choices of a batched completions call.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Protocol

from edgefinfer.decoding import tool_calls
from edgefinfer.server_gpu.request import ChoiceDelta, RequestOutput
from edgefinfer.server_gpu.sampler import TokenLogprob
from edgefinfer.tokenization.tokenizer import Tokenizer


class Builder(Protocol):
    def start_chunks(self) -> list[dict[str, Any]]: ...
    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict[str, Any]]: ...
    def add(self, prompt_index: int, out: RequestOutput) -> None: ...
    def final(self) -> dict[str, Any]: ...
    def usage_chunk(self) -> dict[str, Any]: ...


class _Base:
    object_final = ""
    object_chunk = ""

    def __init__(self, tokenizer: Tokenizer, request_id: str, model: str, created: int, n: int, logprobs: bool):
        self.tokenizer, self.id, self.model, self.created, self.n = tokenizer, request_id, model, created, n
        self.want_logprobs = logprobs
        self.texts: dict[int, str] = defaultdict(str)
        self.finish: dict[int, str | None] = {}
        self.logprobs: dict[int, list[TokenLogprob]] = defaultdict(list)
        self._prompt_tokens: dict[int, int] = {}
        self._completion_tokens: dict[int, int] = {}
        self._pieces: dict[int, str] = {}

    # ---- shared --------------------------------------------------------------------------------------
    def _record(self, prompt_index: int, out: RequestOutput) -> None:
        self._prompt_tokens[prompt_index] = out.num_prompt_tokens
        self._completion_tokens[prompt_index] = out.num_output_tokens

    def _index(self, prompt_index: int, delta: ChoiceDelta) -> int:
        return prompt_index * self.n + delta.index

    def usage(self) -> dict[str, int]:
        p, c = sum(self._prompt_tokens.values()), sum(self._completion_tokens.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def piece(self, token_id: int) -> str:
        """The text of one token (special tokens included), cached per call."""
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        self._record(prompt_index, out)
        for d in out.deltas:
            i = self._index(prompt_index, d)
            self.texts[i] += d.text
            if d.logprobs:
                self.logprobs[i].extend(d.logprobs)
            if d.finish_reason is not None:
                self.finish[i] = d.finish_reason

    def start_chunks(self) -> list[dict[str, Any]]:
        return []

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._head(self.object_chunk), "choices": [], "usage": self.usage()}

    def _visible_deltas(self, prompt_index: int, out: RequestOutput):
        """(choice index, delta) for each delta a streaming client must see (text, logprobs or an end)."""
        self._record(prompt_index, out)
        for d in out.deltas:
            if d.text or d.finish_reason or d.logprobs:
                yield self._index(prompt_index, d), d

    def _choices(self) -> list[int]:
        return sorted(set(self.texts) | set(self.finish))


class CompletionBuilder(_Base):
    object_final = object_chunk = "text_completion"

    def _logprobs(self, items: list[TokenLogprob], offset: int) -> dict[str, Any]:
        tokens = [self.piece(t.token_id) for t in items]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [t.logprob for t in items],
                "top_logprobs": [{self.piece(i): lp for i, lp in t.top} for t in items], "text_offset": offsets}

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict[str, Any]]:
        chunks = []
        for i, d in self._visible_deltas(prompt_index, out):
            lp = self._logprobs(d.logprobs, len(self.texts[i])) if self.want_logprobs and d.logprobs else None
            self.texts[i] += d.text
            chunks.append({**self._head(self.object_chunk), "choices": [
                {"index": i, "text": d.text, "logprobs": lp, "finish_reason": _public(d.finish_reason)}]})
        return chunks

    def final(self) -> dict[str, Any]:
        choices = [{"index": i, "text": self.texts[i],
                    "logprobs": self._logprobs(self.logprobs[i], 0) if self.want_logprobs else None,
                    "finish_reason": _public(self.finish.get(i))} for i in self._choices()]
        return {**self._head(self.object_final), "choices": choices, "usage": self.usage()}


class ChatBuilder(_Base):
    """Chat bodies and chunks. With `tools`, a reply that is a call list comes back as `tool_calls`
    (finish_reason "tool_calls"); while streaming, text that may still become a call is held back, and
    the calls go out in one delta once the reply ends (they parse only whole)."""

    object_final = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, *args, tools: bool = False, **kw):
        super().__init__(*args, **kw)
        self.tools = tools
        self._held: dict[int, str] = defaultdict(str)  # streamed text not yet sent: it may be a call
        self._plain: set[int] = set()  # choices known to answer in text

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.piece(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _logprobs(self, items: list[TokenLogprob]) -> dict[str, Any]:
        return {"content": [{**self._entry(t.token_id, t.logprob),
                             "top_logprobs": [self._entry(i, lp) for i, lp in t.top]} for t in items]}

    def start_chunks(self) -> list[dict[str, Any]]:
        # The role comes first, once per choice, as OpenAI streams it.
        return [{**self._head(self.object_chunk), "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
            for i in range(self.n)]

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict[str, Any]]:
        chunks = []
        for i, d in self._visible_deltas(prompt_index, out):
            delta, finish = self._stream_delta(i, d)
            if not delta and finish is None and not d.logprobs:
                continue
            lp = self._logprobs(d.logprobs) if self.want_logprobs and d.logprobs else None
            chunks.append({**self._head(self.object_chunk), "choices": [
                {"index": i, "delta": delta, "logprobs": lp, "finish_reason": _public(finish)}]})
        return chunks

    def _stream_delta(self, i: int, d: ChoiceDelta) -> tuple[dict[str, Any], str | None]:
        if not self.tools or i in self._plain:
            return ({"content": d.text} if d.text else {}), d.finish_reason
        held = self._held[i] + d.text
        if d.finish_reason is None and tool_calls.could_be_call(held):
            self._held[i] = held
            return {}, None
        self._held.pop(i, None)
        calls = tool_calls.parse_tool_calls(held) if d.finish_reason is not None else None
        if calls:
            return {"tool_calls": [{"index": j, **c} for j, c in enumerate(calls)]}, "tool_calls"
        self._plain.add(i)
        return ({"content": held} if held else {}), d.finish_reason

    def final(self) -> dict[str, Any]:
        choices = []
        for i in self._choices():
            message: dict[str, Any] = {"role": "assistant", "content": self.texts[i]}
            finish = self.finish.get(i)
            calls = tool_calls.parse_tool_calls(self.texts[i]) if self.tools else None
            if calls:
                message, finish = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
            choices.append({"index": i, "message": message,
                            "logprobs": self._logprobs(self.logprobs[i]) if self.want_logprobs else None,
                            "finish_reason": _public(finish)})
        return {**self._head(self.object_final), "choices": choices, "usage": self.usage()}


def _public(reason: str | None) -> str | None:
    """OpenAI knows "stop" and "length"; "abort" (as vLLM says it) reaches a client only when a shutdown's
    grace period ended its request (a client that left sees nothing)."""
    return reason if reason in (None, "stop", "length", "tool_calls", "abort") else "stop"
