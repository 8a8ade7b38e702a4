"""SFT samples from chat data: messages -> ``input_ids``, ``labels`` and ``loss_mask``, prompt masked.

:func:`chat_sample` renders a conversation (a list of ``{"role", "content"}`` messages) with a
chat template and tokenizes it. Only the assistant turns carry loss: their content and end
marker get ``labels`` equal to ``input_ids`` and ``loss_mask`` 1; everything else (system and
user turns, every role header, the generation prompt) gets ``labels`` -100 and ``loss_mask`` 0.
``labels`` are not shifted (the model shifts them, as Hugging Face models do); with
``shift_labels=True`` they are: ``labels[t]`` (and ``loss_mask[t]``) is the target of position
``t``, the token after it, the last one -100 (0), and the model must not shift again. Shifted
labels are what :class:`~meshfeed.balance.BalancedBatches` needs under context parallelism or
``long_documents="split"``: it cuts a document into pieces on different ranks or rows, and a
shift inside the model would pair each piece's last position with the wrong token (or none).

The template is, in this order: ``template=`` (a :class:`ChatTemplate` of plain strings, a
:class:`JinjaChatTemplate`, or a tokenizer folder whose ``tokenizer_config.json`` has a
``chat_template``); the tokenizer's own ``apply_chat_template`` (a ``transformers`` tokenizer);
the tokenizer folder's template; else the plain :class:`ChatTemplate` default. The masks come
from rendering the conversation one message longer at a time, so they are exact for any
template that renders a conversation as an extension of its first messages (each rendered
piece is tokenized on its own). No message renders as "": an empty conversation is never
rendered (templates such as Qwen's, Llama 3's or Mistral's read ``messages[0]`` or add a
default system prompt), except for the generation prompt before a conversation that starts
with an assistant message. :class:`ChatSamples` is a dataset of them with ``lengths``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from meshfeed.sources.tokens.tokenizer import TextTokenizer, load_tokenizer

__all__ = ["ChatSamples", "ChatTemplate", "JinjaChatTemplate", "chat_sample"]

Messages = Sequence[Mapping[str, Any]]
TRAINED_ROLES = ("assistant",)


@runtime_checkable
class ChatTemplateTokenizer(Protocol):
    """A tokenizer with its own chat template (``transformers``' ``apply_chat_template``)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatTemplate:
    """A plain chat template: each message is ``prefix + content + suffix`` of its role.

    The generation prompt is the assistant's prefix; ``bos`` starts every conversation.
    """

    roles: Mapping[str, tuple[str, str]] = field(
        default_factory=lambda: {
            "system": ("<|system|>\n", "\n"),
            "user": ("<|user|>\n", "\n"),
            "assistant": ("<|assistant|>\n", "<|end|>\n"),
        }
    )
    bos: str = ""

    def render(self, messages: Messages, add_generation_prompt: bool = False) -> str:
        parts = [self.bos]
        for m in messages:
            if m["role"] not in self.roles:
                raise ValueError(
                    f"role {m['role']!r} is not in this template's roles {sorted(self.roles)}; "
                    "add it to ChatTemplate(roles=...)"
                )
            prefix, suffix = self.roles[m["role"]]
            parts += [prefix, m["content"], suffix]
        if add_generation_prompt:
            parts.append(self.roles["assistant"][0])
        return "".join(parts)


class JinjaChatTemplate:
    """A Jinja chat template, as tokenizers ship it in ``tokenizer_config.json``.

    Rendered like ``transformers`` does (sandboxed, ``trim_blocks``, ``lstrip_blocks``, with
    ``bos_token``, ``eos_token``, ``add_generation_prompt`` and ``raise_exception``).
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self._compiled: Any = None

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> JinjaChatTemplate | None:
        """The ``chat_template`` of a tokenizer folder's ``tokenizer_config.json``, if any."""
        path = Path(folder) / "tokenizer_config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        source = config.get("chat_template")
        if not isinstance(source, str):
            return None
        return cls(
            source,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"source": self.source, "bos_token": self.bos_token, "eos_token": self.eos_token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._compiled = None

    def render(self, messages: Messages, add_generation_prompt: bool = False) -> str:
        if self._compiled is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._compiled = env.from_string(self.source)
        return str(
            self._compiled.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        )


def _token_text(token: Any) -> str:
    if isinstance(token, Mapping):  # an AddedToken written as a dict
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""


def _raise(message: str) -> None:
    raise ValueError(f"the chat template refused the conversation: {message}")


Renderer = Callable[[Messages, bool], str]


def _renderer(tokenizer: Any, template: Any) -> Renderer:
    if isinstance(template, (str, os.PathLike)):
        found = JinjaChatTemplate.from_folder(template)
        if found is None:
            raise ValueError(
                f"template={os.fspath(template)!r} has no tokenizer_config.json with a "
                "chat_template; pass a ChatTemplate or JinjaChatTemplate"
            )
        template = found
    if template is not None:
        return template.render
    if isinstance(tokenizer, ChatTemplateTokenizer):
        tok = tokenizer
        return lambda msgs, gen: str(
            tok.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=gen)
        )
    if isinstance(tokenizer, (str, os.PathLike)) and Path(tokenizer).is_dir():
        found = JinjaChatTemplate.from_folder(tokenizer)
        if found is not None:
            return found.render
    return ChatTemplate().render


def _check_messages(messages: Any, index: int | None) -> None:
    where = "" if index is None else f" of sample {index}"
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(
            f"the conversation{where} is a {type(messages).__name__}; give a list of "
            "{'role': ..., 'content': ...} messages"
        )
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            keys = sorted(m) if isinstance(m, Mapping) else type(m).__name__
            raise ValueError(
                f"message {k}{where} has no 'role' (got {keys}); give every message a role "
                "('system', 'user' or 'assistant') and a content"
            )
        if not isinstance(m.get("content"), str):
            raise ValueError(
                f"message {k}{where} (role {m['role']!r}) has no text 'content' "
                f"(got {type(m.get('content')).__name__}); give it a string"
            )


def _pieces(messages: Messages, render: Renderer) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, trained) pieces, in order.

    The first piece is what the template renders for no message (a preamble), where it can
    render that and the first message extends it; else "": templates read ``messages[0]``
    (to find a system message) or add a default system prompt that the conversation's own
    replaces. The generation prompt before a conversation that starts with a trained message
    needs the empty rendering (:func:`_head`).
    """
    done = _preamble(messages, render)
    pieces: list[tuple[str, bool]] = [(done, False)]
    for k, m in enumerate(messages):
        trained = m["role"] in TRAINED_ROLES
        head = _head(messages, k, render) if trained else done
        full = render(messages[: k + 1], False)
        if not (head.startswith(done) and full.startswith(head)):
            raise ValueError(
                f"the chat template does not render message {k} as an extension of the "
                "messages before it, so its tokens cannot be masked exactly; use a template "
                "that appends each message (ChatTemplate or the tokenizer's own)"
            )
        pieces += [(head[len(done) :], False), (full[len(head) :], trained)]
        done = full
    return [(t, tr) for t, tr in pieces if t]


def _preamble(messages: Messages, render: Renderer) -> str:
    """The template's rendering of no message, if it has one the first message extends."""
    if not messages:
        return ""
    try:
        empty = render([], False)
    except Exception:  # a template that reads messages[0]
        return ""
    return empty if render(messages[:1], False).startswith(empty) else ""


def _head(messages: Messages, k: int, render: Renderer) -> str:
    """The messages before message ``k`` rendered with the generation prompt."""
    if k > 0:
        return render(messages[:k], True)
    try:
        return render([], True)
    except Exception as e:  # a template that reads messages[0] cannot render no message
        raise ValueError(
            f"the conversation starts with a message of role {messages[0]['role']!r}, and the "
            "chat template cannot render the generation prompt before it (rendering no message "
            f"raised {type(e).__name__}: {e}), so the prompt tokens of that message cannot be "
            "masked exactly; start the conversation with a system or user message, or use a "
            "template that renders an empty conversation"
        ) from e


def chat_sample(
    messages: Messages,
    tokenizer: Any,
    *,
    template: ChatTemplate | JinjaChatTemplate | str | os.PathLike[str] | None = None,
    index: int | None = None,
    shift_labels: bool = False,
) -> dict[str, torch.Tensor]:
    """``input_ids`` / ``labels`` / ``loss_mask`` of one conversation (see the module doc).

    ``tokenizer`` is anything :func:`~meshfeed.sources.tokens.tokenizer.load_tokenizer` takes; ``index``
    names the sample in errors (a message without a role, content that is not text);
    ``shift_labels``: labels (and the loss mask) of the next token (see the module doc).

    >>> s = chat_sample([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "bytes")
    >>> bytes(s["input_ids"][s["loss_mask"] > 0].tolist())
    b'yo<|end|>\\n'
    """
    _check_shift(shift_labels)
    return _tokenize(
        messages, _renderer(tokenizer, template), load_tokenizer(tokenizer), index, shift_labels
    )


def _check_shift(shift_labels: Any) -> None:
    if not isinstance(shift_labels, bool):
        raise TypeError(
            f"shift_labels must be True or False (got {shift_labels=!r}); True when the model "
            "does not shift labels itself (under context parallelism or split documents)"
        )


def _tokenize(
    messages: Messages,
    render: Renderer,
    encode: TextTokenizer,
    index: int | None,
    shift_labels: bool = False,
) -> dict[str, torch.Tensor]:
    _check_messages(messages, index)
    ids, mask = [], []
    for text, trained in _pieces(messages, render):
        tokens = encode(text)
        ids.append(tokens)
        mask.append(np.full(tokens.size, trained))
    input_ids = torch.from_numpy(np.concatenate(ids) if ids else np.zeros(0, np.int64))
    trained_mask = torch.from_numpy(np.concatenate(mask) if mask else np.zeros(0, bool))
    labels = torch.where(trained_mask, input_ids, torch.full_like(input_ids, -100))
    if shift_labels:  # position t is trained to predict token t + 1
        labels = torch.cat([labels[1:], labels.new_full((min(1, labels.numel()),), -100)])
        trained_mask = torch.cat(
            [trained_mask[1:], trained_mask.new_zeros(min(1, trained_mask.numel()))]
        )
    return {"input_ids": input_ids, "labels": labels, "loss_mask": trained_mask.to(torch.float32)}


class ChatSamples:
    """A map-style dataset of :func:`chat_sample` dicts over a dataset of conversations.

    An item of ``conversations`` is a list of messages or a mapping with ``messages``.
    ``lengths`` (what :class:`~meshfeed.balance.PackedSamples` plans with) tokenizes every
    conversation once on first use and keeps the array; pass ``lengths=`` to skip that.
    ``shift_labels``: labels of the next token (the module doc says when).
    """

    def __init__(
        self,
        conversations: Any,
        tokenizer: Any,
        *,
        template: ChatTemplate | JinjaChatTemplate | str | os.PathLike[str] | None = None,
        lengths: Any = None,
        shift_labels: bool = False,
    ) -> None:
        _check_shift(shift_labels)
        self.conversations, self.tokenizer, self.template = conversations, tokenizer, template
        self.shift_labels = shift_labels
        self._lengths = None if lengths is None else np.asarray(lengths, dtype=np.int64)
        self._encode = load_tokenizer(tokenizer)
        self._render: Renderer | None = None

    def __getstate__(self) -> dict[str, Any]:
        # a tokenizer's bound template may not pickle: made again
        return {**self.__dict__, "_render": None}

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = self.conversations[i]
        messages = item["messages"] if isinstance(item, Mapping) else item
        if self._render is None:
            self._render = _renderer(self.tokenizer, self.template)
        return _tokenize(messages, self._render, self._encode, int(i), self.shift_labels)

    @property
    def lengths(self) -> np.ndarray:
        if self._lengths is None:
            n = len(self)
            self._lengths = np.fromiter(
                (self[i]["input_ids"].shape[0] for i in range(n)), np.int64, n
            )
        return self._lengths
