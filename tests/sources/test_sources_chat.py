from __future__ import annotations

import itertools
import json
import pickle
from typing import Any

import numpy as np
import pytest
import torch

from meshfeed.balance import PackedSamples, SampleFields
from meshfeed.sources.tokens.chat import ChatSamples, ChatTemplate, JinjaChatTemplate, chat_sample
from tests.optional import given, importable, settings, st

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2.5's chat_template without its tools branches: like Qwen2, Llama-3.x and Mistral it reads
# messages[0] (an empty conversation raises) and adds a default system prompt.
QWEN = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
# The same head written to tolerate an empty list: no message renders the default system prompt.
DEFAULT_SYSTEM = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}{%- if not (loop.first and m.role == 'system') %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
NEEDS_JINJA = pytest.mark.skipif(
    not importable("jinja2"), reason="needs jinja2 (installed with torch), which is not installed"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And three plus three?"},
    {"role": "assistant", "content": "Six."},
]


def _bpe() -> Any:
    """A byte-level BPE trained on ``CHAT``; skips the test where tokenizers is missing."""
    tk = pytest.importorskip("tokenizers", reason="pip install tokenizers (the test extra)")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([m["content"] for m in CHAT] * 20, trainer)
    return tok


def _trained_text(sample, decode) -> str:
    return decode(sample["input_ids"][sample["loss_mask"] > 0].tolist())


def test_plain_template_trains_only_the_assistant_turns():
    s = chat_sample(CHAT, "bytes")
    assert s["input_ids"].shape == s["labels"].shape == s["loss_mask"].shape
    text = bytes(s["input_ids"].tolist()).decode()
    assert text == ChatTemplate().render(CHAT)
    assert bytes(s["input_ids"][s["loss_mask"] > 0].tolist()) == b"Four.<|end|>\nSix.<|end|>\n"
    assert (s["labels"][s["loss_mask"] == 0] == -100).all()
    assert torch.equal(s["labels"][s["loss_mask"] > 0], s["input_ids"][s["loss_mask"] > 0])


def test_jinja_template_with_a_trained_bpe_tokenizer_masks_the_prompt():
    tok = _bpe()
    s = chat_sample(CHAT, tok, template=JinjaChatTemplate(CHATML))
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    assert _trained_text(s, decode) == "Four.<|im_end|>\nSix.<|im_end|>\n"
    header = tok.encode("<|im_start|>assistant\n").ids
    ids = s["input_ids"].tolist()
    first = next(k for k in range(len(ids)) if ids[k : k + len(header)] == header)
    assert s["loss_mask"][: first + len(header)].sum() == 0  # the header is not trained


def test_a_tokenizer_folder_brings_its_chat_template(tmp_path):
    tok = _bpe()
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": CHATML, "bos_token": "", "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    by_folder = chat_sample(CHAT, str(tmp_path))
    by_template = chat_sample(CHAT, tok, template=JinjaChatTemplate(CHATML))
    assert torch.equal(by_folder["input_ids"], by_template["input_ids"])
    assert torch.equal(by_folder["loss_mask"], by_template["loss_mask"])


class _ChatTokenizer:
    """Stands in for a transformers tokenizer (not installed here): encode + apply_chat_template."""

    def __init__(self) -> None:
        self.template = JinjaChatTemplate(CHATML)
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, conversation, *, tokenize, add_generation_prompt):
        assert tokenize is False
        self.calls += 1
        return self.template.render(conversation, add_generation_prompt)


def test_a_tokenizer_with_apply_chat_template_renders_its_own_template():
    tok = _ChatTokenizer()
    s = chat_sample(CHAT, tok)
    assert tok.calls > 0
    assert _trained_text(s, lambda ids: bytes(ids).decode()) == (
        "Four.<|im_end|>\nSix.<|im_end|>\n"
    )


def test_a_message_without_a_role_is_refused_naming_the_sample():
    with pytest.raises(ValueError, match="message 1 of sample 4 has no 'role'"):
        chat_sample([CHAT[0], {"content": "hi"}], "bytes", index=4)
    with pytest.raises(ValueError, match="message 0 \\(role 'user'\\) has no text 'content'"):
        chat_sample([{"role": "user"}], "bytes")
    with pytest.raises(ValueError, match="role 'tool' is not in this template's roles"):
        chat_sample([{"role": "tool", "content": "x"}, CHAT[2]], "bytes")


def test_a_template_that_rewrites_earlier_messages_is_refused():
    last_only = JinjaChatTemplate("{{ messages[-1]['content'] if messages else '' }}")
    with pytest.raises(ValueError, match="does not render message 1 as an extension"):
        chat_sample(CHAT[:3], "bytes", template=last_only)


def test_chat_samples_pack_with_no_loss_on_prompt_tokens():
    conversations = [{"messages": CHAT[: 3 + k % 3]} for k in range(40)]  # each with an answer
    samples = ChatSamples(conversations, "bytes", template=JinjaChatTemplate(CHATML))
    samples = pickle.loads(pickle.dumps(samples))  # worker processes get a copy
    rows = PackedSamples(
        samples,
        max_tokens=512,
        fields=SampleFields(token_fields=("input_ids", "labels", "loss_mask")),
    )
    trained = 0
    for r in range(len(rows)):
        row = rows[r]
        mask = row["loss_mask"] > 0
        assert (row["labels"][~mask] == -100).all()
        assert torch.equal(row["labels"][mask], row["input_ids"][mask])
        trained += int(mask.sum())
    want = sum(int(samples[i]["loss_mask"].sum()) for i in range(len(samples)))
    assert trained == want > 0
    assert samples.lengths.tolist() == [len(samples[i]["input_ids"]) for i in range(len(samples))]
    assert np.array_equal(ChatSamples(conversations, "bytes", lengths=[1] * 40).lengths, [1] * 40)


@settings(max_examples=40, deadline=None)
@given(
    turns=st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=12)),
        max_size=6,
    ),
    jinja=st.booleans(),
)
def test_exactly_the_assistant_turns_are_trained(turns, jinja):
    messages = [{"role": r, "content": c} for r, c in turns]
    template = JinjaChatTemplate(CHATML) if jinja else ChatTemplate()
    if all(m["role"] != "assistant" for m in messages):  # nothing to train: refused
        with pytest.raises(ValueError, match="no message of the conversation has a trained role"):
            chat_sample(messages, "bytes", template=template)
        return
    s = chat_sample(messages, "bytes", template=template)
    end = "<|im_end|>\n" if jinja else "<|end|>\n"
    want = "".join(m["content"] + end for m in messages if m["role"] == "assistant")
    assert bytes(s["input_ids"][s["loss_mask"] > 0].tolist()).decode() == want
    assert bytes(s["input_ids"].tolist()).decode() == template.render(messages)
    assert (s["labels"][s["loss_mask"] == 0] == -100).all()


def _bytes_text(ids: torch.Tensor) -> str:
    return bytes(ids.tolist()).decode()


@NEEDS_JINJA
@pytest.mark.parametrize("source", [QWEN, DEFAULT_SYSTEM], ids=["qwen", "default_system"])
@pytest.mark.parametrize("system", [True, False], ids=["own_system", "no_system"])
def test_templates_that_read_the_first_message_mask_exactly(source, system):
    template = JinjaChatTemplate(source)
    chat = CHAT if system else CHAT[1:]
    s = chat_sample(chat, "bytes", template=template)
    rendered = template.render(chat)
    assert _bytes_text(s["input_ids"]) == rendered
    assert ("Be brief." in rendered) is system
    assert ("You are" in rendered) is not system  # the template's default system prompt
    assert _bytes_text(s["input_ids"][s["loss_mask"] > 0]) == "Four.<|im_end|>\nSix.<|im_end|>\n"
    assert (s["labels"][s["loss_mask"] == 0] == -100).all()
    n = len(template.render(chat[:-1], True).encode())  # the prompt of the last answer
    head = s["input_ids"][:n][s["loss_mask"][:n] > 0]
    assert _bytes_text(head) == "Four.<|im_end|>\n"
    assert _bytes_text(s["input_ids"][n:]) == "Six.<|im_end|>\n"
    assert s["loss_mask"][n:].all()
    short = chat[: 3 if system else 2]  # up to the first answer
    samples = ChatSamples([chat, short], "bytes", template=template)
    assert samples.lengths.tolist() == [len(rendered), len(template.render(short))]


@NEEDS_JINJA
def test_a_conversation_that_starts_with_the_assistant_masks_its_header():
    chat = CHAT[2:]
    s = chat_sample(chat, "bytes", template=JinjaChatTemplate(DEFAULT_SYSTEM))
    assert _bytes_text(s["input_ids"][s["loss_mask"] > 0]) == "Four.<|im_end|>\nSix.<|im_end|>\n"
    with pytest.raises(
        ValueError, match="starts with a message of role 'assistant'.*UndefinedError"
    ):
        chat_sample(chat, "bytes", template=JinjaChatTemplate(QWEN))


@NEEDS_JINJA
@settings(max_examples=40, deadline=None)
@given(
    turns=st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=12)),
        max_size=6,
    ),
)
def test_a_qwen_template_trains_exactly_the_assistant_turns(turns):
    messages = [{"role": r, "content": c} for r, c in turns]
    template = JinjaChatTemplate(QWEN)
    if messages and messages[0]["role"] == "assistant":
        with pytest.raises(ValueError, match="cannot render the generation prompt"):
            chat_sample(messages, "bytes", template=template)
        return
    if all(m["role"] != "assistant" for m in messages):  # nothing to train: refused
        with pytest.raises(ValueError, match="no message of the conversation has a trained role"):
            chat_sample(messages, "bytes", template=template)
        return
    s = chat_sample(messages, "bytes", template=template)
    want = "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
    assert _bytes_text(s["input_ids"][s["loss_mask"] > 0]) == want
    assert _bytes_text(s["input_ids"]) == template.render(messages)
    assert (s["labels"][s["loss_mask"] == 0] == -100).all()


def _trained_pairs(steps: Any) -> list[tuple[int, int]]:
    """(input token, target) of every trained position, with labels already shifted."""
    pairs = []
    for s in steps:
        keep = s["labels"] != -100
        pairs += list(zip(s["input_ids"][keep].tolist(), s["labels"][keep].tolist(), strict=True))
    return sorted(pairs)


def test_shifted_labels_keep_every_next_token_pair_through_split_documents():
    """With shift_labels=True, position t's label is token t + 1: BalancedBatches may cut a
    conversation into pieces (long_documents="split") and every trained pair survives, where a
    shift inside the model would lose the pair at each cut."""
    from meshfeed import DataLoader
    from meshfeed.balance import BalancedBatches, merge_rows

    chats = [
        [{"role": "user", "content": "q" * (3 + i)}, {"role": "assistant", "content": "a" * 40}]
        for i in range(6)
    ]
    plain = [chat_sample(c, "bytes") for c in chats]
    shifted = ChatSamples(chats, "bytes", shift_labels=True)
    for p, s in zip(plain, map(shifted.__getitem__, range(len(chats))), strict=True):
        assert torch.equal(s["input_ids"], p["input_ids"])
        assert torch.equal(s["labels"][:-1], p["labels"][1:]) and int(s["labels"][-1]) == -100
        assert (
            torch.equal(s["loss_mask"][:-1], p["loss_mask"][1:]) and float(s["loss_mask"][-1]) == 0
        )
    want = _trained_pairs(shifted[i] for i in range(len(chats)))
    keys = ("input_ids", "labels", "loss_mask", "position_ids")
    pad = {"input_ids": 0, "labels": -100, "loss_mask": 0, "position_ids": None}
    rows = PackedSamples(shifted, max_tokens=256, fields=SampleFields(token_fields=keys[:3]))
    loader = DataLoader(rows, batch_size=1, collate_fn=merge_rows, drop_last=False)
    with BalancedBatches(loader, max_tokens=32, keys=keys, pad=pad, long_documents="split") as it:
        steps = list(it)
    assert max(int((s["cu_seqlens"][1:] - s["cu_seqlens"][:-1]).max()) for s in steps) <= 32
    assert _trained_pairs(steps) == want  # every pair once, none across a cut
    # The same pipeline unshifted, the model shifting within each document piece: the pair
    # at every cut inside an answer is lost
    rows = PackedSamples(
        ChatSamples(chats, "bytes"), max_tokens=256, fields=SampleFields(token_fields=keys[:3])
    )
    loader = DataLoader(rows, batch_size=1, collate_fn=merge_rows, drop_last=False)
    with BalancedBatches(loader, max_tokens=32, keys=keys, pad=pad, long_documents="split") as it:
        model_side = []
        for s in it:
            cu = s["cu_seqlens"].tolist()
            for a, b in itertools.pairwise(cu):
                x, y = s["input_ids"][a : b - 1].tolist(), s["labels"][a + 1 : b].tolist()
                model_side += [(i, t) for i, t in zip(x, y, strict=True) if t != -100]
    assert len(model_side) < len(want)
    with pytest.raises(TypeError, match="shift_labels must be True or False"):
        ChatSamples(chats, "bytes", shift_labels="yes")
