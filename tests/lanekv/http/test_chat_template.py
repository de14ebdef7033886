"""Chat templates render as transformers' ``apply_chat_template`` renders them."""

from __future__ import annotations

import json

import pytest
from lanekv.model.tokenizer import load_tokenizer

from lanekv.http.chat import ChatTemplate
from lanekv.http.errors import APIError
from tests.checkpoints import write_tokenizer
from tests.lanekv.http.front import CHAT_TEMPLATE

# A ChatML-like template with the features real ones use: a namespace, loop
# controls, tojson, a default system prompt and raise_exception.
CHATML = """{%- set ns = namespace(system=false) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' %}{% set ns.system = true %}{% endif -%}
{%- endfor -%}
{%- if not ns.system %}w20 default w21
{% endif -%}
{%- for m in messages -%}
  {%- if m.role not in ['system', 'user', 'assistant'] -%}
    {{ raise_exception('role ' ~ m.role ~ ' is not allowed') }}
  {%- endif -%}
  {%- if m.role == 'assistant' and loop.last %}{% break %}{% endif -%}
w22 {{ m.role }} {{ m.content if m.content is string else m.content | tojson }} w23
{% endfor -%}
{%- if add_generation_prompt %}w22 assistant
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "w5 w6"}],
    [{"role": "system", "content": "w7"}, {"role": "user", "content": "w8 w9"},
     {"role": "assistant", "content": "w30 w31"}, {"role": "user", "content": "w40"}],
    [{"role": "user", "content": "héllo «quoted»"}, {"role": "assistant", "content": "w50"}],
    [{"role": "user", "content": [{"type": "text", "text": "w60"}]}],
]


def _checkpoint(tmp_path, template: str):
    write_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": template,
    }))
    return tmp_path


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, CHATML], ids=["indented", "chatml"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_equals_transformers(tmp_path, template, add_generation_prompt):
    from transformers import AutoTokenizer

    path = _checkpoint(tmp_path, template)
    hf = AutoTokenizer.from_pretrained(path)
    ours = ChatTemplate.from_dir(path)
    tokenizer = load_tokenizer(path)
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
        text = ours.render(messages, add_generation_prompt)
        assert text == expected
        ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False,
                                     add_generation_prompt=add_generation_prompt)
        assert tokenizer.encode(text, add_special_tokens=False) == list(ids)


def test_template_file_wins_and_special_tokens_as_dicts(tmp_path):
    write_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "ignored", "bos_token": {"content": "<s>", "special": True}}))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}|{{ messages[0]['content'] }}")
    assert ChatTemplate.from_dir(tmp_path).render([{"role": "user", "content": "x"}]) == "<s>|x"


def test_named_templates_take_default(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]}))
    assert ChatTemplate.from_dir(tmp_path).render([{"role": "user", "content": "x"}]) == "plain"


def test_no_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert ChatTemplate.from_dir(tmp_path) is None
    assert ChatTemplate.from_dir(tmp_path / "missing") is None


def test_template_refusal_is_a_400_on_messages(tmp_path):
    template = ChatTemplate.from_dir(_checkpoint(tmp_path, CHATML))
    with pytest.raises(APIError) as err:
        template.render([{"role": "tool", "content": "x"}])
    assert err.value.status == 400 and err.value.param == "messages"
    assert "role tool is not allowed" in err.value.message


def test_sandbox_refuses_unsafe_attributes(tmp_path):
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(APIError) as err:
        template.render([{"role": "user", "content": "x"}])
    assert err.value.param == "messages"


def test_bad_template_source():
    with pytest.raises(ValueError, match="chat_template does not compile"):
        ChatTemplate("{% for %}", {})
