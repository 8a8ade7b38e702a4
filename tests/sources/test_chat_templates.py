"""Chat templates read and rendered as transformers does them, trained roles, dataset items."""

from __future__ import annotations

import json
import pickle
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from meshfeed.sources.tokens.chat import ChatSamples, ChatTemplate, JinjaChatTemplate, chat_sample
from meshfeed.sources.tokens.tokenizer import load_tokenizer
from tests.optional import importable
from tests.sources.test_sources_chat import CHAT, CHATML

pytestmark = pytest.mark.skipif(
    not importable("jinja2"), reason="needs jinja2 (installed with torch), which is not installed"
)
ANSWERS = "Four.<|im_end|>\nSix.<|im_end|>\n"
# The same ChatML with the end marker taken from the folder's eos_token
CHATML_EOS = CHATML.replace("<|im_end|>", "{{ eos_token }}")
TOOL_USE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"


def _trained(sample: dict[str, Any]) -> str:
    return bytes(sample["input_ids"][sample["loss_mask"] > 0].tolist()).decode()


def _text(sample: dict[str, Any]) -> str:
    return bytes(sample["input_ids"].tolist()).decode()


def _folder(path: Path, config: dict[str, Any], files: dict[str, str] | None = None) -> Path:
    path.mkdir()
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


def _char_tokenizer(folder: Path) -> None:
    """A tokenizer.json of one token per printable character (needs tokenizers)."""
    tk = pytest.importorskip("tokenizers", reason="pip install tokenizers (the test extra)")
    vocab = {chr(i): i for i in range(32, 127)} | {"\n": 127, "[UNK]": 128}
    tok = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Split("", "isolated")
    tok.save(str(folder / "tokenizer.json"))


EOS = {"eos_token": "<|im_end|>"}
LAYOUTS = {
    # transformers >= 4.5x save_pretrained: the template in its own file, none in the config
    "chat_template.jinja": (EOS, {"chat_template.jinja": CHATML_EOS}),
    # the file wins over a stale config entry, as in transformers
    "jinja_over_config": ({**EOS, "chat_template": TOOL_USE}, {"chat_template.jinja": CHATML}),
    "config_string": ({**EOS, "chat_template": CHATML_EOS}, {}),
    # older multi-template configs: the one named "default"
    "config_named_list": (
        {
            **EOS,
            "chat_template": [
                {"name": "tool_use", "template": TOOL_USE},
                {"name": "default", "template": CHATML_EOS},
            ],
        },
        {},
    ),
    # a processor's chat_template.json
    "chat_template.json": (EOS, {"chat_template.json": json.dumps({"chat_template": CHATML})}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_folder_chat_template_is_read_where_transformers_keeps_it(tmp_path, layout):
    config, files = LAYOUTS[layout]
    folder = _folder(tmp_path / "tok", config, files)
    found = JinjaChatTemplate.from_folder(folder)
    assert found is not None and found.eos_token == "<|im_end|>"
    assert found.render(CHAT) == JinjaChatTemplate(CHATML).render(CHAT)
    s = chat_sample(CHAT, "bytes", template=str(folder))  # template=folder
    assert _text(s) == JinjaChatTemplate(CHATML).render(CHAT)
    assert _trained(s) == ANSWERS


def test_a_tokenizer_folder_brings_its_chat_template_jinja(tmp_path):
    folder = _folder(tmp_path / "tok", EOS, {"chat_template.jinja": CHATML_EOS})
    _char_tokenizer(folder)
    by_folder = ChatSamples([CHAT], str(folder))[0]
    by_template = chat_sample(CHAT, str(folder), template=JinjaChatTemplate(CHATML))
    assert by_folder["input_ids"].tolist() == by_template["input_ids"].tolist()
    assert by_folder["loss_mask"].tolist() == by_template["loss_mask"].tolist()
    # The answers' tokens, as this folder's tokenizer makes them: one per character with
    # tokenizers alone; with transformers, AutoTokenizer adds the eos_token "<|im_end|>",
    # which the vocabulary lacks, as one special token (13 tokens, not 31).
    answers = load_tokenizer(str(folder))(ANSWERS).tolist()
    assert by_folder["input_ids"][by_folder["loss_mask"] > 0].tolist() == answers
    assert len(answers) == (13 if importable("transformers") else len(ANSWERS))


def test_named_templates_without_a_default_are_refused_naming_them(tmp_path):
    templates = [{"name": "tool_use", "template": TOOL_USE}, {"name": "rag", "template": CHATML}]
    folder = _folder(tmp_path / "tok", {"chat_template": templates})
    with pytest.raises(ValueError, match=r"named \['rag', 'tool_use'\] but none named 'default'"):
        chat_sample(CHAT, "bytes", template=str(folder))
    chosen = JinjaChatTemplate.from_folder(folder, name="tool_use")
    assert chosen is not None and chosen.source == TOOL_USE
    extra = _folder(tmp_path / "extra", {}, {"additional_chat_templates/rag.jinja": CHATML})
    chosen = JinjaChatTemplate.from_folder(extra, name="rag")
    assert chosen is not None and chosen.source == CHATML


def test_a_tokenizer_folder_without_a_chat_template_is_refused(tmp_path):
    folder = _folder(tmp_path / "tok", EOS)
    _char_tokenizer(folder)
    want = (
        rf"folder '{folder}' has no chat template \(looked at chat_template.jinja, "
        r"tokenizer_config.json's 'chat_template' and chat_template.json's 'chat_template'\); "
        r"pass template=ChatTemplate\(...\) or "
        r"template=JinjaChatTemplate\(...\)"
    )
    with pytest.raises(ValueError, match=want):
        chat_sample(CHAT, str(folder))
    with pytest.raises(ValueError, match=want):  # at construction, not at the first sample
        ChatSamples([CHAT], str(folder))
    with pytest.raises(ValueError, match=want):
        chat_sample(CHAT, "bytes", template=str(folder))
    # an explicit template is used as given
    s = chat_sample(CHAT, str(folder), template=ChatTemplate())
    assert s["loss_mask"].sum() == len("Four.<|end|>\nSix.<|end|>\n")
    # a tokenizer without a folder keeps the plain default
    assert _text(chat_sample(CHAT, "bytes")) == ChatTemplate().render(CHAT)


TOOLCALL = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tojson_is_transformers_json_dumps():
    args = {"query": "café <b> & 'x'", "city": "Zürich"}
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "web", "arguments": args}}],
    }
    s = chat_sample([CHAT[1], call], "bytes", template=JinjaChatTemplate(TOOLCALL))
    dumped = json.dumps(args, ensure_ascii=False)  # keys in order, no HTML escapes
    assert (
        _trained(s)
        == f'<tool_call>\n{{"name": "web", "arguments": {dumped}}}\n</tool_call><|im_end|>\n'
    )
    options = JinjaChatTemplate(
        "{{ messages[0] | tojson(indent=2) }}|{{ messages[0] | tojson(sort_keys=True) }}|"
        "{{ messages[0] | tojson(separators=(',', ':')) }}"
    )
    m = {"role": "user", "content": "é<"}
    assert options.render([m]) == "|".join(
        [
            json.dumps(m, ensure_ascii=False, indent=2),
            json.dumps(m, ensure_ascii=False, sort_keys=True),
            json.dumps(m, ensure_ascii=False, separators=(",", ":")),
        ]
    )


def test_loopcontrols_generation_and_globals_render_as_in_transformers():
    first_two = JinjaChatTemplate(
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }};{% endfor %}"
    )
    assert first_two.render(CHAT) == "What is two plus two?;"
    generation = CHATML.replace(
        "{{ m['content'] }}<|im_end|>\n",
        "{% if m.role == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n"
        "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}",
    )
    marked = chat_sample(CHAT, "bytes", template=JinjaChatTemplate(generation))
    plain = chat_sample(CHAT, "bytes", template=JinjaChatTemplate(CHATML))
    assert marked["input_ids"].tolist() == plain["input_ids"].tolist()  # the body, unchanged
    assert _trained(marked) == ANSWERS
    from jinja2.exceptions import TemplateError

    refuse = JinjaChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateError, match="^roles must alternate$"):
        refuse.render(CHAT)
    before = datetime.now().strftime("%Y-%m-%d")
    today = JinjaChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render([])
    assert today in {before, datetime.now().strftime("%Y-%m-%d")}


SHAREGPT = ChatTemplate(
    roles={"human": ("Human: ", "\n"), "gpt": ("GPT: ", "</s>\n")}, generation_role="gpt"
)
HUMAN_GPT = [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "hello"}]


def test_trained_roles_train_other_answer_roles():
    s = chat_sample(HUMAN_GPT, "bytes", template=SHAREGPT, trained_roles=("gpt",))
    assert _text(s) == "Human: hi\nGPT: hello</s>\n"
    assert _trained(s) == "hello</s>\n"  # the "GPT: " header masked
    model = JinjaChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
        "{% if add_generation_prompt %}<model>{% endif %}"
    )
    chat = [{"role": "user", "content": "hi"}, {"role": "model", "content": "hello"}]
    assert _trained(chat_sample(chat, "bytes", template=model, trained_roles=["model"])) == (
        "hello</model>"
    )
    samples = ChatSamples([HUMAN_GPT] * 3, "bytes", template=SHAREGPT, trained_roles=("gpt",))
    samples = pickle.loads(pickle.dumps(samples))
    assert _trained(samples[2]) == "hello</s>\n"
    assert samples.lengths.tolist() == [len("Human: hi\nGPT: hello</s>\n")] * 3
    # the default, for chats that answer as the assistant, is unchanged
    assert _trained(chat_sample(CHAT, "bytes")) == "Four.<|end|>\nSix.<|end|>\n"


def test_a_conversation_with_no_trained_role_is_refused():
    want = (
        r"no message of the conversation( of sample 0)? has a trained role \(its roles: "
        r"\['gpt', 'human'\], trained_roles=\('assistant',\)\).*pass trained_roles="
    )
    with pytest.raises(ValueError, match=want):
        chat_sample(HUMAN_GPT, "bytes", template=SHAREGPT)
    with pytest.raises(ValueError, match=want):
        ChatSamples([HUMAN_GPT], "bytes", template=SHAREGPT)[0]
    with pytest.raises(ValueError, match=r"its roles: \['system', 'user'\]"):
        chat_sample(CHAT[:2], "bytes")  # a prompt without an answer trains nothing
    for bad in ("gpt", [1], None):
        with pytest.raises(TypeError, match="trained_roles must be a sequence of role names"):
            chat_sample(HUMAN_GPT, "bytes", template=SHAREGPT, trained_roles=bad)
    with pytest.raises(ValueError, match="trained_roles is empty"):
        ChatSamples([HUMAN_GPT], "bytes", template=SHAREGPT, trained_roles=())


def test_a_trained_role_the_template_does_not_generate_is_refused_by_name():
    plain = ChatTemplate(roles=SHAREGPT.roles)  # generation_role "assistant" is not a role
    with pytest.raises(ValueError, match=r"prefix of role 'assistant'.*generation_role="):
        chat_sample(HUMAN_GPT, "bytes", template=plain, trained_roles=("gpt",))
    tool = [*CHAT[1:3], {"role": "tool", "content": "4"}]
    with pytest.raises(ValueError, match=r"message 2 \(role 'tool'\) does not start with"):
        chat_sample(
            tool, "bytes", template=JinjaChatTemplate(CHATML), trained_roles=("assistant", "tool")
        )


def test_a_mapping_item_without_messages_is_refused_naming_its_keys():
    sharegpt = {"id": 7, "conversations": [{"from": "human", "value": "hi"}]}
    samples = ChatSamples([{"messages": CHAT}, sharegpt], "bytes")
    assert _trained(samples[0]) == "Four.<|end|>\nSix.<|end|>\n"
    with pytest.raises(
        ValueError,
        match=r"sample 1 is a mapping without 'messages' \(its keys: \['conversations', 'id'\]\)"
        r".*map them to \{'role', 'content'\}",
    ):
        samples[1]
