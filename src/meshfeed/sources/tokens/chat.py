"""SFT samples from chat data: messages -> ``input_ids``, ``labels`` and ``loss_mask``, prompt masked.

:func:`chat_sample` renders a conversation (a list of ``{"role", "content"}`` messages) with a
chat template and tokenizes it. Only the turns of ``trained_roles`` (``("assistant",)`` unless
told, e.g. ``("gpt",)`` for ShareGPT roles or ``("model",)``) carry loss: their content and end
marker get ``labels`` equal to ``input_ids`` and ``loss_mask`` 1; everything else (system and
user turns, every role header, the generation prompt) gets ``labels`` -100 and ``loss_mask`` 0.
A conversation with no message of a trained role is refused, never trained on nothing.
``labels`` are not shifted (the model shifts them, as Hugging Face models do); with
``shift_labels=True`` they are: ``labels[t]`` (and ``loss_mask[t]``) is the target of position
``t``, the token after it, the last one -100 (0), and the model must not shift again. Shifted
labels are what :class:`~meshfeed.balance.BalancedBatches` needs under context parallelism or
``long_documents="split"``: it cuts a document into pieces on different ranks or rows, and a
shift inside the model would pair each piece's last position with the wrong token (or none).

The template is, in this order: ``template=`` (a :class:`ChatTemplate` of plain strings, a
:class:`JinjaChatTemplate`, or a tokenizer folder with a chat template); the tokenizer's own
``apply_chat_template`` (a ``transformers`` tokenizer); the tokenizer folder's template (read as
``transformers`` reads it, see :meth:`JinjaChatTemplate.from_folder`; a folder without one is
refused); else (``"bytes"``, a ``tokenizer.json``, a tiktoken name, an encode function) the
plain :class:`ChatTemplate` default. The masks come from rendering the conversation one message
longer at a time, so they are exact for any template that renders a conversation as an
extension of its first messages (each rendered piece is tokenized on its own). No message
renders as "": an empty conversation is never rendered (templates such as Qwen's, Llama 3's or
Mistral's read ``messages[0]`` or add a default system prompt), except for the generation
prompt before a conversation that starts with a trained message. :class:`ChatSamples` is a
dataset of them with ``lengths``.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Protocol, runtime_checkable

import numpy as np
import torch

from meshfeed.sources.tokens.tokenizer import TextTokenizer, load_tokenizer

__all__ = ["ChatSamples", "ChatTemplate", "JinjaChatTemplate", "chat_sample"]

Messages = Sequence[Mapping[str, Any]]
#: The roles whose turns are trained unless ``trained_roles=`` says otherwise.
TRAINED_ROLES: tuple[str, ...] = ("assistant",)
#: Where a tokenizer folder keeps its chat template, in the order ``transformers`` reads them.
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json", "chat_template.json")


@runtime_checkable
class ChatTemplateTokenizer(Protocol):
    """A tokenizer with its own chat template (``transformers``' ``apply_chat_template``)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatTemplate:
    """A plain chat template: each message is ``prefix + content + suffix`` of its role.

    The generation prompt is the prefix of ``generation_role`` (the role the model answers as:
    ``"gpt"`` with ShareGPT roles); ``bos`` starts every conversation.
    """

    roles: Mapping[str, tuple[str, str]] = field(
        default_factory=lambda: {
            "system": ("<|system|>\n", "\n"),
            "user": ("<|user|>\n", "\n"),
            "assistant": ("<|assistant|>\n", "<|end|>\n"),
        }
    )
    bos: str = ""
    generation_role: str = "assistant"

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
            if self.generation_role not in self.roles:
                raise ValueError(
                    f"the generation prompt is the prefix of role {self.generation_role!r}, which "
                    f"is not in this template's roles {sorted(self.roles)}; pass "
                    "ChatTemplate(generation_role=...) naming the role the model answers as"
                )
            parts.append(self.roles[self.generation_role][0])
        return "".join(parts)


class JinjaChatTemplate:
    """A Jinja chat template, as tokenizers ship it (``chat_template.jinja`` or in
    ``tokenizer_config.json``).

    Rendered like ``transformers`` does: sandboxed, ``trim_blocks``, ``lstrip_blocks``, the
    ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``), its ``tojson`` filter
    (``json.dumps``: non-ASCII kept, keys in order, no HTML escaping; ``indent``,
    ``separators``, ``sort_keys``), ``raise_exception`` (a ``jinja2.TemplateError``),
    ``strftime_now``, the ``{% generation %}`` tag (its body, unchanged), and ``bos_token``,
    ``eos_token``, ``add_generation_prompt``.
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self._compiled: Any = None

    @classmethod
    def from_folder(
        cls, folder: str | os.PathLike[str], *, name: str = "default"
    ) -> JinjaChatTemplate | None:
        """The chat template of a tokenizer folder, found where ``transformers`` looks, or None.

        In this order: ``chat_template.jinja`` (what ``save_pretrained`` writes now;
        ``additional_chat_templates/<name>.jinja`` for another ``name``), the ``chat_template``
        of ``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}`` of which
        the one named ``name``), then a processor's ``chat_template.json``. ``bos_token`` and
        ``eos_token`` come from ``tokenizer_config.json``. A folder whose templates are named but
        none ``name`` is refused, naming the ones it has.
        """
        folder = Path(folder)
        config = _read_json(folder / "tokenizer_config.json")
        tokens = {
            "bos_token": _token_text(config.get("bos_token")),
            "eos_token": _token_text(config.get("eos_token")),
        }
        jinja = folder / (
            "chat_template.jinja"
            if name == "default"
            else f"additional_chat_templates/{name}.jinja"
        )
        if jinja.is_file():
            return cls(jinja.read_text(encoding="utf-8"), **tokens)
        processor = _read_json(folder / "chat_template.json")
        for file, found in (
            ("tokenizer_config.json", config.get("chat_template")),
            ("chat_template.json", processor.get("chat_template")),
        ):
            if isinstance(found, str) and name == "default":
                return cls(found, **tokens)
            if isinstance(found, list):  # the first file with named templates decides
                named = {t.get("name"): t.get("template") for t in found if isinstance(t, Mapping)}
                source = named.get(name)
                if isinstance(source, str):
                    return cls(source, **tokens)
                raise ValueError(
                    f"{folder / file} has chat templates named {sorted(map(str, named))} but "
                    f"none named {name!r}; pass "
                    "template=JinjaChatTemplate.from_folder(folder, name=...) naming one of them"
                )
        return None

    def __getstate__(self) -> dict[str, Any]:
        return {"source": self.source, "bos_token": self.bos_token, "eos_token": self.eos_token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._compiled = None

    def render(self, messages: Messages, add_generation_prompt: bool = False) -> str:
        if self._compiled is None:
            self._compiled = _jinja_environment().from_string(self.source)
        return str(
            self._compiled.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


def _token_text(token: Any) -> str:
    if isinstance(token, Mapping):  # an AddedToken written as a dict
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""


@functools.cache
def _jinja_environment() -> Any:
    """The environment ``transformers``' ``_compile_jinja_template`` builds, shared."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: the body, unchanged (transformers marks
        the assistant's tokens with it; the masks here come from the messages' roles)."""

        tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it a set)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' override of Jinja's tojson, which escapes HTML and sorts keys
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    from datetime import datetime

    return datetime.now().strftime(format)


def _raise(message: str) -> NoReturn:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


Renderer = Callable[[Messages, bool], str]


def _renderer(tokenizer: Any, template: Any) -> Renderer:
    if isinstance(template, (str, os.PathLike)):
        found = JinjaChatTemplate.from_folder(template)
        if found is None:
            raise _no_template(template, "the template")
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
        if found is None:  # never the plain default in place of the model's own format
            raise _no_template(tokenizer, "the tokenizer")
        return found.render
    return ChatTemplate().render


def _no_template(folder: str | os.PathLike[str], given_as: str) -> ValueError:
    jinja, config, processor = CHAT_TEMPLATE_FILES
    return ValueError(
        f"{given_as} folder {os.fspath(folder)!r} has no chat template (looked at {jinja}, "
        f"{config}'s 'chat_template' and {processor}'s 'chat_template'); pass "
        "template=ChatTemplate(...) or template=JinjaChatTemplate(...) with the format the "
        "model was trained on"
    )


def _check_trained_roles(trained_roles: Any) -> tuple[str, ...]:
    if (
        isinstance(trained_roles, (str, bytes))
        or not isinstance(trained_roles, Sequence)
        or not all(isinstance(r, str) for r in trained_roles)
    ):
        raise TypeError(
            f"trained_roles must be a sequence of role names such as ('assistant',) or "
            f"('gpt',) (got {trained_roles!r})"
        )
    if not trained_roles:
        raise ValueError(
            "trained_roles is empty, so no token would be trained; name the roles whose turns "
            "the model learns, such as trained_roles=('assistant',)"
        )
    return tuple(trained_roles)


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


def _pieces(
    messages: Messages, render: Renderer, trained_roles: Sequence[str] = TRAINED_ROLES
) -> list[tuple[str, bool]]:
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
        trained = m["role"] in trained_roles
        head = _head(messages, k, render) if trained else done
        full = render(messages[: k + 1], False)
        if (
            trained
            and head.startswith(done)
            and full.startswith(done)
            and not full.startswith(head)
        ):
            raise ValueError(
                f"message {k} (role {m['role']!r}) does not start with the chat template's "
                f"generation prompt {head[len(done) :]!r}, so its header cannot be masked; "
                "train only the role the template generates (trained_roles=...; for a "
                "ChatTemplate, generation_role= names it)"
            )
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
    trained_roles: Sequence[str] = TRAINED_ROLES,
) -> dict[str, torch.Tensor]:
    """``input_ids`` / ``labels`` / ``loss_mask`` of one conversation (see the module doc).

    ``tokenizer`` is anything :func:`~meshfeed.sources.tokens.tokenizer.load_tokenizer` takes; ``index``
    names the sample in errors (a message without a role, content that is not text);
    ``shift_labels``: labels (and the loss mask) of the next token (see the module doc);
    ``trained_roles``: the roles whose turns carry loss (``("gpt",)`` for ShareGPT roles).

    >>> s = chat_sample([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "bytes")
    >>> bytes(s["input_ids"][s["loss_mask"] > 0].tolist())
    b'yo<|end|>\\n'
    """
    _check_shift(shift_labels)
    roles = _check_trained_roles(trained_roles)
    return _tokenize(
        messages,
        _renderer(tokenizer, template),
        load_tokenizer(tokenizer),
        index,
        shift_labels,
        roles,
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
    trained_roles: Sequence[str] = TRAINED_ROLES,
) -> dict[str, torch.Tensor]:
    _check_messages(messages, index)
    if not any(m["role"] in trained_roles for m in messages):
        where = "" if index is None else f" of sample {index}"
        raise ValueError(
            f"no message of the conversation{where} has a trained role (its roles: "
            f"{sorted({str(m['role']) for m in messages})}, trained_roles={tuple(trained_roles)}), "
            "so none of its tokens would be trained; pass trained_roles=(...) naming the roles "
            "the model learns to write (such as ('gpt',) or ('model',)), or drop conversations "
            "without an answer"
        )
    ids, mask = [], []
    for text, trained in _pieces(messages, render, trained_roles):
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
    ``shift_labels``: labels of the next token (the module doc says when); ``trained_roles``:
    the roles whose turns carry loss. The template is found (or refused) here, not at the first
    sample.
    """

    def __init__(
        self,
        conversations: Any,
        tokenizer: Any,
        *,
        template: ChatTemplate | JinjaChatTemplate | str | os.PathLike[str] | None = None,
        lengths: Any = None,
        shift_labels: bool = False,
        trained_roles: Sequence[str] = TRAINED_ROLES,
    ) -> None:
        _check_shift(shift_labels)
        self.trained_roles = _check_trained_roles(trained_roles)
        self.conversations, self.tokenizer, self.template = conversations, tokenizer, template
        self.shift_labels = shift_labels
        self._lengths = None if lengths is None else np.asarray(lengths, dtype=np.int64)
        self._encode = load_tokenizer(tokenizer)
        self._render: Renderer | None = _renderer(tokenizer, template)

    def __getstate__(self) -> dict[str, Any]:
        # a tokenizer's bound template may not pickle: made again
        return {**self.__dict__, "_render": None}

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = self.conversations[i]
        if isinstance(item, Mapping) and "messages" not in item:
            raise ValueError(
                f"sample {i} is a mapping without 'messages' (its keys: "
                f"{sorted(map(str, item))}); give each item a list of {{'role', 'content'}} "
                "messages or a mapping with 'messages' (ShareGPT's 'conversations' of "
                "{'from', 'value'}: map them to {'role', 'content'} first)"
            )
        messages = item["messages"] if isinstance(item, Mapping) else item
        if self._render is None:
            self._render = _renderer(self.tokenizer, self.template)
        try:
            return _tokenize(
                messages, self._render, self._encode, int(i), self.shift_labels, self.trained_roles
            )
        except Exception as e:  # e.g. the template's raise_exception (a jinja2 TemplateError)
            if f"sample {i}" not in str(e):
                e.add_note(f"(ChatSamples sample {i})")
            raise

    @property
    def lengths(self) -> np.ndarray:
        if self._lengths is None:
            n = len(self)
            self._lengths = np.fromiter(
                (self[i]["input_ids"].shape[0] for i in range(n)), np.int64, n
            )
        return self._lengths
